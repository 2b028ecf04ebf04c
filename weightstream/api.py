"""The one entry point every caller uses: ``load_weights`` and ``iter_weights``."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch

from weightstream.errors import OptionError, TensorNotFound
from weightstream.loaders.base import Loader
from weightstream.memory.devices import check_fits
from weightstream.options import LoadOptions
from weightstream.planning.plan import LoadPlan
from weightstream.registry import get_loader
from weightstream.sources import REMOTE_SCHEMES

AUTO = "auto"


def resolve_format(uri: str) -> str:
    """The format ``format="auto"`` picks for ``uri``.

    Object-store URIs (``s3://``, ``gs://``, ``http(s)://``) resolve to ``"streaming"``
    (bounded memory, completion order), local paths to ``"safetensors"``. Either reads one
    ``.safetensors`` file, a directory (or prefix) with ``model.safetensors.index.json``, or
    one of ``*.safetensors`` files. (Pickle files are refused by the loader.)

    Example:
        >>> resolve_format("model.safetensors"), resolve_format("s3://bucket/llama/")
        ('safetensors', 'streaming')
    """
    return "streaming" if uri.startswith(REMOTE_SCHEMES) else "safetensors"


def plan_load(uri: str | os.PathLike[str], format: str = AUTO, **options: Any) -> tuple[Loader, LoadPlan, LoadOptions]:
    """Check the options, pick the loader and read the headers, without reading tensor data.

    Example:
        >>> loader, plan, opts = plan_load("model.safetensors")  # doctest: +SKIP
        >>> plan.total_bytes  # doctest: +SKIP
        268435456
    """
    opts = LoadOptions.from_kwargs(**options)
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str):
        raise OptionError(f"uri must be a path or a URI string, got {type(uri).__name__}")
    if not isinstance(format, str):
        raise OptionError(f"format must be a string, got {type(format).__name__}")
    loader = get_loader(resolve_format(uri) if format == AUTO else format)
    return loader, loader.plan(uri, opts), opts


def iter_weights(uri: str | os.PathLike[str], format: str = AUTO, **options: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` pairs as each tensor's bytes land, in completion order.

    Options are checked and headers read when this is called (so bad options and
    malformed headers raise here); tensor data is read while you iterate. Stopping
    early (``break``, ``close()``) stops the readers and releases what was not yielded.

    Args:
        uri: a ``.safetensors`` file or a checkpoint directory.
        format: a registered format name, or ``"auto"`` (see :func:`resolve_format`).
        **options: fields of :class:`weightstream.LoadOptions` (``device``, ``threads``,
            ``chunk_bytes``, ``filter``, ``huge_pages``, ``progress``).

    Raises:
        OptionError: an unknown option, before any I/O.
        WeightstreamError: any other failure, typed (see ``weightstream.errors``).

    Example:
        >>> for name, tensor in iter_weights("model/", filter=lambda n: "layers.0." in n):  # doctest: +SKIP
        ...     print(name, tuple(tensor.shape))
    """
    loader, plan, opts = plan_load(uri, format, **options)
    return loader.iter_weights(plan, opts)


def iter_layers(uri: str | os.PathLike[str], **options: Any) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Yield ``(layer key, {name: tensor})`` layer by layer, in layer order, through reused buffers.

    Embeddings first, then ``model.layers.0``, ``model.layers.1``, ..., then the final norm and
    the head (``layer_rule`` changes what a layer is; see ``weightstream.planning.layers``). The next
    ``prefetch_layers`` layers are read while you work on one. The memory held is
    ``prefetch_layers + 1`` buffers of the largest layer's size, reused layer after layer.

    The contract: the tensors are views of those buffers. When you ask for a layer, you may still
    hold (reference, through any view) at most ``prefetch_layers`` earlier layers; a buffer comes
    back the moment the last tensor of its layer dies. Holding more raises ``LayerInUseError``
    (nothing is overwritten under you). Keep what you need as copies, or pass
    ``copy_layers=True``. ``layer_hook(key, tensors)`` runs on each complete layer, in order,
    before it is yielded; what it returns (e.g. quantized tensors) is yielded instead.

    Raises:
        LayerInUseError: a layer was asked for while more earlier layers than allowed were still referenced.
        WeightstreamError: as :func:`iter_weights`.

    Example:
        >>> for key, tensors in iter_layers("model/", device="cuda"):  # doctest: +SKIP
        ...     model.get_submodule(key).load_state_dict(strip_prefix(tensors, key))  # copies out of the buffer
    """
    loader, plan, opts = plan_load(uri, "layered", **options)
    return loader.iter_layers(plan, opts)


def load_weights(uri: str | os.PathLike[str], format: str = AUTO, device: str = "cpu", **options: Any) -> dict[str, torch.Tensor]:
    """Load every (selected) tensor: all of them, or an error and none.

    The dict is ordered as the tensors are stored (file by file, by offset); with a ``layer_hook`` it
    holds what the hook returned (tensors it added, such as quantization scales, after the stored
    ones; tensors it renamed or dropped, as it left them). A loader that reuses its memory
    (``layered``) is asked for copies (``copy_layers=True``), since every tensor is kept.

    Example:
        >>> weights = load_weights("model.safetensors")  # doctest: +SKIP
        >>> weights["model.embed_tokens.weight"].dtype  # doctest: +SKIP
        torch.bfloat16
    """
    loader, plan, opts = plan_load(uri, format, device=device, **options)
    if torch.device(opts.device).type == "cuda":  # the readers hold a window of it; the dict keeps all of it
        check_fits(plan.total_bytes, opts.device, plan.uri)
    if getattr(loader, "reuses_memory", False):
        opts = dataclasses.replace(opts, copy_layers=True)
    loaded: dict[str, torch.Tensor] = {}
    try:
        for name, tensor in loader.iter_weights(plan, opts):
            loaded[name] = tensor
    except BaseException:
        loaded.clear()  # a traceback keeps this frame alive; the memory must not wait for it
        raise
    return _in_stored_order(loaded, plan, opts, loader.name)


def _in_stored_order(loaded: dict[str, torch.Tensor], plan: LoadPlan, opts: LoadOptions, loader: str) -> dict[str, torch.Tensor]:
    """``loaded`` in the plan's order, then what a ``layer_hook`` added (or renamed) in the order it came.

    Without a hook every planned tensor must be there: one missing is a loader's failure, not a result."""
    ordered = {spec.name: loaded[spec.name] for spec in plan.tensors if spec.name in loaded}
    if opts.layer_hook is None and len(ordered) < len(plan.tensors):
        missing = next(spec.name for spec in plan.tensors if spec.name not in loaded)
        raise TensorNotFound(f"{plan.uri}: the {loader} loader ended without yielding tensor {missing!r}")
    ordered.update((name, tensor) for name, tensor in loaded.items() if name not in ordered)
    return ordered
