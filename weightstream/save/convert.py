"""Converting a Hugging Face Llama-style checkpoint into a tensor-parallel sharded state.

Each tensor is split for ``tp`` ranks by the first rule whose pattern it matches
(``re.search`` on the name): a dimension (rank ``r`` keeps the ``r``-th of ``tp`` equal slices
along it) or ``None`` (every rank keeps the whole tensor). The Llama rules (Megatron's layout,
as vLLM and SGLang shard these layers):

- column-parallel, dim 0: ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj`` (weights and biases);
- row-parallel, dim 1: ``o_proj``, ``down_proj`` weights (their biases are replicated);
- vocab-parallel, dim 0: ``embed_tokens`` and ``lm_head``;
- replicated: norms (``*norm.weight``, ``*layernorm.weight``) and ``rotary_emb.inv_freq``.

Rules given by the caller come first. A tensor no rule matches, or a dimension that does not
divide by ``tp``, is an error before anything is written. Concatenating the ranks' slices along
each rule's dimension gives back the source, byte for byte.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence

import torch

from weightstream.checkpoint.calls import load_weights
from weightstream.errors import InvalidOptionError, logger
from weightstream.formats.index import INDEX_NAME
from weightstream.save import engine_naming
from weightstream.save.saver import DEFAULT_MAX_FILE_BYTES, save_sharded_state
from weightstream.sources import REMOTE_SCHEMES
from weightstream.sources.local.regular import read_regular

log = logger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".gguf")
"""Files beside a checkpoint that are weights, never copied into a conversion's output."""
MAX_COMPANION_BYTES = 256 << 20
"""The largest file copied beside the converted weights (a tokenizer is a few MB; a larger one is no companion)."""

SplitRule = tuple[str, "int | None"]
"""(pattern, dimension to split, or None to replicate)."""

LLAMA_RULES: tuple[SplitRule, ...] = (
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", 0),
    (r"\.(o_proj|down_proj)\.weight$", 1),
    (r"\.(o_proj|down_proj)\.bias$", None),
    (r"(^|\.)(embed_tokens|lm_head)\.weight$", 0),
    (r"norm\.weight$", None),
    (r"(^|\.)rotary_emb\.inv_freq$", None),
)
"""The split rules of Llama, Mistral and Qwen (dense) checkpoints."""


def split_dimension(name: str, shape: Sequence[int], tp: int, rules: Sequence[SplitRule]) -> int | None:
    """The dimension ``name`` is split along for ``tp`` ranks (None: replicated).

    Raises:
        InvalidOptionError: no rule matches, or the dimension does not divide by ``tp``.

    Example:
        >>> split_dimension("model.layers.0.self_attn.o_proj.weight", (64, 64), 2, LLAMA_RULES)
        1
    """
    for pattern, dimension in rules:
        if re.search(pattern, name):
            if dimension is None:
                return None
            if not -len(shape) <= dimension < len(shape):
                raise InvalidOptionError(
                    f"tensor {name!r} of shape {tuple(shape)}: rule {pattern!r} splits dimension {dimension}, which it "
                    "lacks"
                )
            if shape[dimension] % tp:
                raise InvalidOptionError(
                    f"tensor {name!r} of shape {tuple(shape)}: dimension {dimension} ({shape[dimension]}) does not "
                    f"divide by tp={tp} (rule {pattern!r})"
                )
            return dimension % len(shape)
    raise InvalidOptionError(
        f"tensor {name!r} matches no split rule; add one (e.g. --rule '{re.escape(name)}=0' or '=replicate')"
    )


def convert_to_sharded_state(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    *,
    tp: int,
    rules: Sequence[SplitRule] = LLAMA_RULES,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    progress: Callable[[int], None] | None = None,
    engine: str | None = None,
) -> dict[str, object]:
    """Split the checkpoint at ``source`` for ``tp`` tensor-parallel ranks and save each rank's
    state in ``destination`` (atomically, manifest last, as :func:`save_sharded_state`).

    Every split is checked before a byte is written. Local sources are read as file mappings
    (``zero_copy``), so the conversion needs no memory of its own for the source. With ``engine``
    (``"vllm"`` or ``"sglang"``) each rank is saved in that engine's naming
    (:mod:`weightstream.save.engine_naming`: fused ``qkv_proj`` and ``gate_up_proj``, the vocabulary
    padded), which the engines' ``sharded_state`` loaders (and ``weightstream-sharded-state``) read;
    without, the tensors keep the checkpoint's names.

    Returns:
        ``{"tp": tp, "files": [...], "split": {name: dimension or None}}``.

    Example:
        >>> convert_to_sharded_state("llama-8b/", "llama-8b-tp2/", tp=2)  # doctest: +SKIP
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise InvalidOptionError(f"tp must be a positive integer, got {tp!r}")
    if engine is not None and engine not in engine_naming.ENGINES:
        raise InvalidOptionError(
            f"engine must be one of {', '.join(engine_naming.ENGINES)} (or None for the checkpoint's names), got "
            f"{engine!r}"
        )
    source = os.fspath(source)
    mapped = not source.startswith(REMOTE_SCHEMES)
    if mapped:
        _check_outside(source, os.fspath(destination))
    if engine is not None:
        if not mapped:
            raise InvalidOptionError(f"{source}: engine naming reads the model's config.json beside a local checkpoint")
        engine_naming.check_heads(source, tp)
    weights = load_weights(source, zero_copy=mapped)
    if engine is not None:
        weights = engine_naming.pad_vocabulary(weights)
    split = {name: split_dimension(name, tuple(tensor.shape), tp, rules) for name, tensor in weights.items()}
    states = [{name: _slice(tensor, split[name], tp, rank) for name, tensor in weights.items()} for rank in range(tp)]
    if engine is not None:
        states = [
            engine_naming.engine_state(state, engine) for state in states
        ]  # checked for every rank before a byte is written
    files = []
    for rank, state in enumerate(states):
        files += save_sharded_state(
            state, destination, rank=rank, world_size=tp, max_file_bytes=max_file_bytes, progress=progress
        )
    copied = _copy_companions(source, os.fspath(destination)) if mapped else []  # into the directory the saves made
    return {"tp": tp, "files": files, "split": split, "engine": engine, "copied": copied}


def _check_outside(source: str, destination: str) -> None:
    """Refuse a destination that is the source's directory or inside it: its files would join the checkpoint."""
    directory = os.path.realpath(source if os.path.isdir(source) else os.path.dirname(source) or ".")
    target = os.path.realpath(destination)
    if target == directory or target.startswith(directory + os.sep):
        raise InvalidOptionError(
            f"{destination}: is inside the checkpoint being converted ({directory}); write the sharded state elsewhere"
        )


def _copy_companions(source: str, destination: str) -> list[str]:
    """Copy the files beside a local checkpoint that are not weights (``config.json``, the tokenizer's files,
    ``generation_config.json``, ...) into ``destination``, each written under a temporary name and renamed, so that
    an engine pointed at the sharded state finds them; the names copied."""
    directory = source if os.path.isdir(source) else os.path.dirname(source) or "."
    copied = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(WEIGHT_SUFFIXES) or name == INDEX_NAME or name.startswith(".") or not os.path.isfile(path):
            continue
        if os.path.getsize(path) > MAX_COMPANION_BYTES:
            log.warning("%s: %d bytes, not copied beside the converted weights", path, os.path.getsize(path))
            continue
        data = read_regular(path, MAX_COMPANION_BYTES)
        temporary = os.path.join(destination, f".{name}.partial")
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, os.path.join(destination, name))
        copied.append(name)
    return copied


def _slice(tensor: torch.Tensor, dimension: int | None, tp: int, rank: int) -> torch.Tensor:
    if dimension is None:
        return tensor
    size = tensor.shape[dimension] // tp
    return tensor.narrow(dimension, rank * size, size)


def parse_rule(text: str) -> SplitRule:
    """``"PATTERN=DIM"`` or ``"PATTERN=replicate"`` (the CLI's ``--rule``) as a rule.

    Example:
        >>> parse_rule(r"\\.w1\\.weight$=0"), parse_rule("scale=replicate")
        (('\\\\.w1\\\\.weight$', 0), ('scale', None))
    """
    pattern, separator, dimension = text.rpartition("=")
    if not separator or not pattern:
        raise InvalidOptionError(f"a rule is PATTERN=DIM or PATTERN=replicate, got {text!r}")
    try:
        re.compile(pattern)
    except re.error as error:
        raise InvalidOptionError(f"rule {text!r}: {pattern!r} is not a regular expression: {error}") from None
    if dimension == "replicate":
        return pattern, None
    try:
        return pattern, int(dimension)
    except ValueError:
        raise InvalidOptionError(f"rule {text!r}: {dimension!r} is neither a dimension nor 'replicate'") from None
