"""The one entry point every caller uses: ``load_weights`` and ``iter_weights``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from weightstream.errors import OptionError
from weightstream.loaders.base import Loader
from weightstream.options import LoadOptions
from weightstream.plan import LoadPlan
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


def load_weights(uri: str | os.PathLike[str], format: str = AUTO, device: str = "cpu", **options: Any) -> dict[str, torch.Tensor]:
    """Load every (selected) tensor: all of them, or an error and none.

    The dict is ordered as the tensors are stored (file by file, by offset).

    Example:
        >>> weights = load_weights("model.safetensors")  # doctest: +SKIP
        >>> weights["model.embed_tokens.weight"].dtype  # doctest: +SKIP
        torch.bfloat16
    """
    loader, plan, opts = plan_load(uri, format, device=device, **options)
    loaded: dict[str, torch.Tensor] = {}
    try:
        for name, tensor in loader.iter_weights(plan, opts):
            loaded[name] = tensor
    except BaseException:
        loaded.clear()  # a traceback keeps this frame alive; the memory must not wait for it
        raise
    return {spec.name: loaded[spec.name] for spec in plan.tensors}
