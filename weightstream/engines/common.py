"""What the engine adapters share: the load formats they offer, the options they pass through, and
the completeness check engines do not do themselves."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Collection, Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any

import torch

import weightstream
from weightstream.errors import EngineUnavailableError, InvalidOptionError, WeightsMismatchError, logger
from weightstream.formats.sharded_state import DEFAULT_PATTERN, PP_PATTERN, Rank
from weightstream.registry import AUTO, available_loaders, check_options

log = logger(__name__)


def engine_formats() -> dict[str, str]:
    """Engine load-format name -> weightstream format: ``weightstream`` (``auto``: safetensors locally,
    streaming from object stores) and ``weightstream-<name>`` for every registered loader, third-party
    ones included.

    Example:
        >>> formats = engine_formats()
        >>> formats["weightstream"], formats["weightstream-sharded-state"]
        ('auto', 'sharded-state')
    """
    return {"weightstream": "auto", **{f"weightstream-{name}": name for name in available_loaders()}}


ENGINE_OWNED = frozenset({"device", "format", "process_group", "rank", "world_size"})
"""Options the engine decides (where its parameters are, its ranks); refused in the extra config."""


def import_engine(module: str, install: str) -> ModuleType:
    """Import an engine's module, or raise ``EngineUnavailableError`` saying how to install it.

    Example:
        >>> import_engine("no_such_engine", "pip install no-such-engine")
        Traceback (most recent call last):
        ...
        weightstream.errors.EngineUnavailableError: this weightstream adapter needs no_such_engine, which is not ...
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise EngineUnavailableError(
            f"this weightstream adapter needs {module.split('.')[0]}, which is not installed here ({install})"
        ) from error


def loader_options(extra: Mapping[str, Any] | None, load_format: str) -> tuple[str | None, dict[str, Any]]:
    """Split an engine's extra loader config into a weights location (``uri``) and weightstream options,
    checked now so that a bad option fails at engine start, not after the model is built.

    Example:
        >>> loader_options({"uri": "s3://bucket/llama", "threads": 16}, "weightstream")
        ('s3://bucket/llama', {'threads': 16})
    """
    options = dict(extra or {})
    uri = options.pop("uri", None)
    if uri is not None and not isinstance(uri, str):
        raise InvalidOptionError(
            f"{load_format}: 'uri' in the extra loader config must be a string, got {type(uri).__name__}"
        )
    owned = sorted(ENGINE_OWNED & options.keys())
    if owned:
        raise InvalidOptionError(
            f"{load_format}: {', '.join(owned)} in the extra loader config: the engine decides these"
        )
    options = engine_cache(options, load_format)
    check_options(
        AUTO if load_format == "weightstream" else load_format.removeprefix("weightstream-"), options, ENGINE_OWNED
    )
    return uri, options


def engine_cache(options: dict[str, Any], load_format: str) -> dict[str, Any]:
    """``options`` with the node cache an engine's load reads through: ``cache`` from the extra config, or
    ``"auto"`` when ``$WEIGHTSTREAM_CACHE`` is set. With ``cache_required`` (default ``False``) a daemon that
    does not answer is an error (``CacheUnavailableError`` at load); without it, the load reads its source,
    and the log says why, once, at engine start.

    Example:
        >>> engine_cache({"threads": 4}, "weightstream")
        {'threads': 4}
    """
    from weightstream.errors import CacheUnavailableError
    from weightstream.nodecache.connection import ENVIRONMENT, find_daemon

    options = dict(options)
    required = options.pop("cache_required", False)
    if not isinstance(required, bool):
        raise InvalidOptionError(f"{load_format}: cache_required must be true or false, got {required!r}")
    if "cache" not in options and os.environ.get(ENVIRONMENT):
        options["cache"] = "auto"
    cache = options.get("cache")
    if cache is None:
        if required:
            raise InvalidOptionError(f"{load_format}: cache_required without a cache (set cache or ${ENVIRONMENT})")
        return options
    if not isinstance(cache, str):
        return options  # the options' own check names the type
    try:
        path = find_daemon(cache)
    except CacheUnavailableError as error:
        if required:
            raise
        log.warning("%s: %s; reading the weights from their source (cache_required is not set)", load_format, error)
        del options["cache"]
        return options
    options["cache"] = path
    return options


def model_weights(
    model: str, revision: str | None, download_dir: str | None, options: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """Where the weights of an engine's model are, and the options to read them with: a local path or URI as
    it is; a Hugging Face id (``org/name``, or ``hf://...``) resolved once, as the engines resolve it (the
    cache first, ``download_dir`` being the engine's cache directory, ``HF_HUB_OFFLINE`` honoured), to the
    cache's snapshot or to ``hf://org/name@<commit>`` (the commit its revision names now: every later read
    of it is of that commit).

    Raises:
        NotFound: an id not in the cache while offline, or not on the Hub.

    Example:
        >>> model_weights("/models/llama", None, None, {})
        ('/models/llama', {})
        >>> model_weights("Qwen/Qwen3-0.6B", None, None, {})  # doctest: +SKIP
        ('/root/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/c1899de2...', {})
    """
    if download_dir is not None and "storage_options" not in options:
        options = {**options, "storage_options": {"cache_dir": download_dir}}
    return weightstream.resolve_model(model, revision, options.get("storage_options")), options


def check_filled(parameters: Collection[str], filled: Collection[str], uri: str) -> None:
    """Raise ``WeightsMismatchError`` naming the model parameters the checkpoint at ``uri`` did not fill.

    Example:
        >>> check_filled({"lm_head.weight", "model.norm.weight"}, {"model.norm.weight"}, "/models/llama")
        Traceback (most recent call last):
        ...
        weightstream.errors.WeightsMismatchError: /models/llama did not fill 1 of the model's 2 parameters: ...
    """
    missing = sorted(set(parameters) - set(filled))
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing) - 8} more)" if len(missing) > 8 else "")
        raise WeightsMismatchError(
            f"{uri} did not fill {len(missing)} of the model's {len(parameters)} parameters: {shown}"
        )


RESIDENT_FOR_MAPPING = 0.5
"""On a CPU engine, ``weightstream`` (``auto``) maps a local checkpoint when at least this fraction of it
is in the page cache, and reads it layer by layer otherwise."""


def checkpoint_reading(
    device: torch.device, uri: str, weightstream_format: str, options: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """The weightstream format and options to read a checkpoint into an engine's model on ``device`` with.

    On a CPU engine the engine copies every tensor into its own parameters, and a local safetensors
    checkpoint is read as measured fastest (``benchmarks/README.md``, vLLM and SGLang sections):
    in the page cache, mapped (``zero_copy``: the engine's copy out of the page cache is the only one;
    warm vLLM 0.56 s against auto's 0.53, through our own memory first 3.4 s); not in it (less than
    ``RESIDENT_FOR_MAPPING``), for ``weightstream`` (``auto``), layer by layer (``layered``: reader threads
    read the next layer from the disk while the engine copies one, where the mapping's reads are
    the page faults of the engine's one copy loop; cold vLLM 1.0-1.16 s mapped 1.15-1.47, auto 1.43-1.8).
    ``weightstream-safetensors`` is always mapped. An explicit ``zero_copy`` is kept as it is.

    Example:
        >>> checkpoint_reading(torch.device("cpu"), "s3://bucket/llama", "auto", {"threads": 8})
        ('auto', {'threads': 8})
    """
    if options.get("cache") is not None:
        # Through the node cache the bytes are shared memory already: views of them, whatever the page cache holds.
        return ("safetensors" if weightstream_format == "auto" else weightstream_format), options
    if (
        device.type != "cpu"
        or "zero_copy" in options
        or weightstream_format not in ("auto", "safetensors")
        or weightstream.resolve_format(uri) != "safetensors"
    ):
        return weightstream_format, options
    if weightstream_format == "auto":
        resident = weightstream.page_cache_residency(uri)
        if resident < RESIDENT_FOR_MAPPING:
            log.info(
                "%s: %.0f%% in the page cache: reading it layer by layer while the engine copies", uri, 100 * resident
            )
            return "layered", options
    return weightstream_format, {**options, "zero_copy": True}


@contextlib.contextmanager
def weight_batches(
    uri: str, weightstream_format: str, device: torch.device, options: dict[str, Any]
) -> Iterator[Iterator[Iterable[tuple[str, torch.Tensor]]]]:
    """What to hand an engine's ``load_weights``, call after call: one iterator of every tensor, or for
    ``layered`` one list per layer (engines' nested weight iterators keep the last tensors they saw
    referenced until they resume, which would pin the layered loader's reused buffers). The load is
    closed on leaving, so that an error in the engine's weight loaders stops its readers at once.

    Example:
        >>> with weight_batches("/models/llama", "layered", torch.device("cpu"), {}) as batches:  # doctest: +SKIP
        ...     for batch in batches:
        ...         model.load_weights(batch)
    """
    if weightstream_format == "layered":
        layers = weightstream.iter_layers(uri, device=str(device), **options)
        with contextlib.closing(layers):
            yield (list(tensors.items()) for _, tensors in layers)
    else:
        weights = weightstream.iter_weights(uri, format=weightstream_format, device=str(device), **options)
        with contextlib.closing(weights):
            yield iter((weights,))


def with_world_group(options: dict[str, Any], parallel_state: ModuleType, device: torch.device) -> dict[str, Any]:
    """``options`` with the engine's world group as ``process_group`` (its CPU group for CPU tensors, its
    device group for GPU ones), from ``parallel_state``: vLLM's ``vllm.distributed`` or SGLang's
    ``sglang.srt.distributed.parallel_state`` (SGLang's derives from vLLM's: the same names).

    Example:
        >>> from vllm import distributed  # doctest: +SKIP
        >>> with_world_group({}, distributed, torch.device("cpu"))  # doctest: +SKIP
        {'process_group': <torch.distributed.distributed_c10d.ProcessGroup ...>}
    """
    group = parallel_state.get_world_group()
    return {**options, "process_group": group.cpu_group if device.type == "cpu" else group.device_group}


def sharded_rank(parallel_state: ModuleType) -> tuple[Rank, Rank, str]:
    """This worker's rank, world size and file names as the engines' ``sharded_state`` has them, from
    ``parallel_state`` (as for :func:`with_world_group`): ``tp_rank``, or ``(pp_rank, tp_rank)`` and the
    pipeline-parallel names when there is more than one stage.

    Example:
        >>> sharded_rank(distributed)  # doctest: +SKIP
        (0, 2, 'model-rank-{rank}-part-{part}.safetensors')
    """
    pp_group = parallel_state.get_pp_group()
    tp_rank, tp_size = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    if pp_group.world_size == 1:
        return tp_rank, tp_size, DEFAULT_PATTERN
    return (pp_group.rank_in_group, tp_rank), (pp_group.world_size, tp_size), PP_PATTERN


def load_sharded_state_into(
    state: dict[str, torch.Tensor], uri: str, *, rank: Rank, world_size: Rank, pattern: str, options: dict[str, Any]
) -> None:
    """Copy this rank's sharded-state tensors at ``uri`` into ``state`` (an engine's state dict, shared
    views dropped), each into its parameter (the front of it where LoRA padded it); every entry must be filled.

    Raises:
        WeightsMismatchError: a tensor the state lacks (or twice), of another dtype or larger, or entries left unfilled.

    Example:
        >>> load_sharded_state_into(model_state, "/models/llama-tp2", rank=0, world_size=2,
        ...                         pattern=DEFAULT_PATTERN, options={})  # doctest: +SKIP
    """
    device = next((tensor.device for tensor in state.values()), torch.device("cpu"))
    remaining = dict(state)
    weights = weightstream.iter_weights(
        uri,
        format="sharded-state",
        device=str(device),
        rank=rank,
        world_size=world_size,
        **{"shard_pattern": pattern, **options},
    )
    with contextlib.closing(weights):  # a mismatch stops the load's readers at once, not when the traceback goes
        for name, tensor in weights:
            parameter = remaining.pop(name, None)
            if parameter is None:
                raise WeightsMismatchError(
                    f"{uri}: tensor {name!r} of rank {rank} is not a parameter of the model"
                    + (" (or came twice)" if name in state else "")
                )
            copy_into_parameter(parameter, tensor, name, uri)
    check_filled(list(state), set(state) - set(remaining), uri)


def copy_into_parameter(parameter: torch.Tensor, tensor: torch.Tensor, name: str, uri: str) -> None:
    """Copy ``tensor`` into ``parameter``, into its front where the parameter is larger (LoRA padding).

    Example:
        >>> copy_into_parameter(torch.zeros(3), torch.ones(2, dtype=torch.float16), "norm.weight", "/models/llama")
        Traceback (most recent call last):
        ...
        weightstream.errors.WeightsMismatchError: /models/llama: tensor 'norm.weight' is torch.float16 (2,); ...
    """
    data = parameter.data
    if (
        tensor.dtype != data.dtype
        or tensor.dim() != data.dim()
        or any(size > limit for size, limit in zip(tensor.shape, data.shape))
    ):
        raise WeightsMismatchError(
            f"{uri}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}; the model's parameter is {data.dtype} "
            f"{tuple(data.shape)}"
        )
    for dim, size in enumerate(tensor.shape):
        if size < data.shape[dim]:
            data = data.narrow(dim, 0, size)
    data.copy_(tensor)


def device_of(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters are (its first parameter's device; CPU without parameters)."""
    return next((parameter.device for parameter in model.parameters()), torch.device("cpu"))
