"""The one-call entry points: ``load_weights``, ``iter_weights`` and ``iter_layers``, each a
:func:`weightstream.open` of the checkpoint that lives as long as the call (or the iterator), through the
checkpoint's public methods."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import torch

from weightstream.checkpoint.handle import Checkpoint
from weightstream.checkpoint.opening import open
from weightstream.registry import AUTO

Item = TypeVar("Item")


def iter_weights(
    uri: str | os.PathLike[str], format: str = AUTO, **options: object
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` pairs as each tensor's bytes land, in completion order.

    Options are checked and headers read when this is called (so bad options and
    malformed headers raise here); tensor data is read while you iterate. Stopping
    early (``break``, ``close()``) stops the readers and releases what was not yielded.

    Args:
        uri: a ``.safetensors`` file or a checkpoint directory.
        format: a registered format name, or ``"auto"`` (see :func:`resolve_format`).
        **options: the core options (fields of :class:`weightstream.LoadOptions`: ``device``, ``threads``,
            ``chunk_bytes``, ``filter``, ...) and the loader's own (``max_inflight_bytes`` of ``streaming``, ...);
            docs/api.md's options table lists them all.

    Raises:
        OptionError: an unknown option, before any I/O.
        WeightstreamError: any other failure, typed (see ``weightstream.errors``).

    Example:
        >>> for name, tensor in iter_weights("model/", filter=lambda n: "layers.0." in n):  # doctest: +SKIP
        ...     print(name, tuple(tensor.shape))
    """
    checkpoint = open(uri, format, **options)
    return ClosingReads(checkpoint, lambda: checkpoint.iter_weights())


def iter_layers(uri: str | os.PathLike[str], **options: object) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
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
    checkpoint = open(uri, "layered", **options)
    return ClosingReads(checkpoint, lambda: checkpoint.iter_layers())


def load_weights(
    uri: str | os.PathLike[str], format: str = AUTO, device: str | torch.device | int = "cpu", **options: object
) -> dict[str, torch.Tensor]:
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
    with open(uri, format, device=device, **options) as checkpoint:
        return checkpoint.load()


class ClosingReads(Generic[Item]):
    """An iterator of a checkpoint opened for it alone: the checkpoint closes when the iterator ends, fails or is
    closed (or cannot start)."""

    def __init__(self, checkpoint: Checkpoint, start: Callable[[], Iterator[Item]]) -> None:
        self._checkpoint = checkpoint
        try:
            self._reads = start()
        except BaseException:
            checkpoint.close()
            raise

    def __iter__(self) -> ClosingReads[Item]:
        return self

    def __next__(self) -> Item:
        try:
            return next(self._reads)
        except BaseException:
            self._checkpoint.close()
            raise

    def close(self) -> None:
        """Stop reading and close the checkpoint (as a generator's ``close()``)."""
        self._checkpoint.close()
