"""Engine naming for a converted sharded state: each rank's tensors as vLLM's and SGLang's own
``sharded_state`` saves hold them, so that the engines' loaders (theirs and ours) fill their
parameters from it by name.

Both engines build Llama-family models with fused projections and a padded vocabulary:

- ``self_attn.qkv_proj`` is ``q_proj``, ``k_proj`` and ``v_proj`` of the rank, one after another
  along dim 0 (weights and biases); ``mlp.gate_up_proj`` is ``gate_proj`` then ``up_proj``;
- ``embed_tokens`` and ``lm_head`` have their vocabulary padded with zero rows to a multiple of
  64 (both engines' default padding) before it is split, so rank ``r`` holds rows
  ``r * padded / tp`` onwards of the padded table, as the engines' own layers do;
- vLLM's attention also keeps four scales per layer (``self_attn.attn._k_scale``, ...), 1.0 for an
  unquantised cache, which its state (and so a converted one) holds after ``o_proj``.

Key-value heads are split like the others, which is only right when their count divides by
``tp`` (the engines replicate them otherwise): that count is read from the ``config.json``
beside the checkpoint, and a conversion it does not allow is refused before anything is written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch

from weightstream.errors import FormatError, InvalidOptionError, WeightstreamError
from weightstream.formats.strict_json import parse_json
from weightstream.sources.local.regular import read_regular

ENGINES = ("vllm", "sglang")
MAX_CONFIG_BYTES = 1 << 20
"""A model's ``config.json`` over this is refused (they are a few KiB)."""
VOCAB_PADDING = 64
"""Both engines pad the vocabulary of their embedding and head to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE)."""
FUSED = (
    (
        re.compile(r"^(?P<module>.*\.self_attn\.)(?P<part>q_proj|k_proj|v_proj)\.(?P<kind>weight|bias)$"),
        "qkv_proj",
        ("q_proj", "k_proj", "v_proj"),
    ),
    (
        re.compile(r"^(?P<module>.*\.mlp\.)(?P<part>gate_proj|up_proj)\.(?P<kind>weight|bias)$"),
        "gate_up_proj",
        ("gate_proj", "up_proj"),
    ),
)
"""(pattern of a part, the fused parameter, its parts in the order the engines stack them)."""
VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")
ATTENTION_OUTPUT = re.compile(r"^(?P<module>.*\.self_attn\.)o_proj\.weight$")
ATTENTION_SCALES = {"vllm": ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"), "sglang": ()}
"""Parameters of each engine's attention that its state holds beside the weights: vLLM's KV-cache and
probability scales, float32 scalars of 1.0 unless a quantised cache was calibrated."""


def check_heads(source: str, tp: int) -> None:
    """Refuse ``tp`` if the model's key-value heads (``config.json`` beside ``source``) do not divide by it.

    Raises:
        InvalidOptionError: no readable ``config.json`` with ``num_attention_heads``, or heads that do not divide.
    """
    path = os.path.join(source if os.path.isdir(source) else os.path.dirname(source), "config.json")
    try:
        config = parse_json(read_regular(path, MAX_CONFIG_BYTES).decode("utf-8"), FormatError, path)
    except (WeightstreamError, UnicodeDecodeError) as error:
        raise InvalidOptionError(
            f"--engine needs the model's config.json beside the checkpoint ({path}): {error}"
        ) from None
    if not isinstance(config, dict):
        raise InvalidOptionError(f"{path}: a model's config.json is a JSON object, this is a {type(config).__name__}")
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise InvalidOptionError(f"{path}: no integer num_attention_heads / num_key_value_heads to split attention by")
    for what, count in (("attention heads", heads), ("key-value heads", kv_heads)):
        if count % tp:
            raise InvalidOptionError(
                f"{path}: {count} {what} do not divide by tp={tp} (the engines would replicate them; this converter "
                "does not)"
            )


def pad_vocabulary(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with the embedding and head padded (zero rows) to a multiple of :data:`VOCAB_PADDING` rows.

    Example:
        >>> pad_vocabulary({"lm_head.weight": torch.ones(100, 2)})["lm_head.weight"].shape
        torch.Size([128, 2])
    """
    padded = dict(weights)
    for name, tensor in weights.items():
        rows = tensor.shape[0]
        if VOCAB.search(name) and rows % VOCAB_PADDING:
            target = -(-rows // VOCAB_PADDING) * VOCAB_PADDING
            grown = torch.zeros((target, *tensor.shape[1:]), dtype=tensor.dtype)
            grown[:rows] = tensor
            padded[name] = grown
    return padded


def engine_state(state: Mapping[str, torch.Tensor], engine: str) -> dict[str, torch.Tensor]:
    """One rank's state in ``engine``'s naming: fused projections (the rest kept, in order) and the
    engine's attention scales.

    Raises:
        InvalidOptionError: a fused parameter lacks one of its parts.

    Example:
        >>> projections = ("q_proj", "k_proj", "v_proj")
        >>> rank = {f"m.self_attn.{p}.weight": torch.full((2, 1), i) for i, p in enumerate(projections)}
        >>> engine_state(rank, "sglang")["m.self_attn.qkv_proj.weight"].flatten().tolist()
        [0, 0, 1, 1, 2, 2]
    """
    with_scales: dict[str, torch.Tensor] = {}
    for name, tensor in fuse(state).items():
        with_scales[name] = tensor
        output = ATTENTION_OUTPUT.match(name)
        if output:
            for scale in ATTENTION_SCALES[engine]:
                with_scales[f"{output['module']}attn.{scale}"] = torch.ones((), dtype=torch.float32)
    return with_scales


def fuse(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One rank's state with the engines' fused projections (the rest kept, in order).

    Raises:
        InvalidOptionError: a fused parameter lacks one of its parts.
    """
    fused: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    orders: dict[str, tuple[str, ...]] = {}
    for name, tensor in state.items():
        for pattern, target, parts in FUSED:
            match = pattern.match(name)
            if match:
                key = f"{match['module']}{target}.{match['kind']}"
                groups.setdefault(key, {})[match["part"]] = tensor
                orders[key] = parts
                fused.setdefault(key, tensor)  # a placeholder keeping the first part's position
                break
        else:
            fused[name] = tensor
    for key, members in groups.items():
        missing = [part for part in orders[key] if part not in members]
        if missing:
            raise InvalidOptionError(
                f"{key} fuses {', '.join(orders[key])}, but the checkpoint has no {missing[0]} for it"
            )
        fused[key] = torch.cat([members[part] for part in orders[key]], dim=0)
    return fused
