"""A checkpoint's iterators: each counts what it hands out into the checkpoint's stats and stops when the
checkpoint closes (its next step then raises ``CheckpointClosedError``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

import torch

from weightstream.checkpoint.reading import CheckpointReads
from weightstream.errors import CheckpointClosedError

Item = TypeVar("Item")


class TrackedReads(Generic[Item]):
    """An iterator of a checkpoint's: counts what it hands out, and stops when the checkpoint closes."""

    def __init__(
        self, checkpoint: CheckpointReads, inner: Iterator[Item], count: Callable[[Item], tuple[int, int]] | None
    ) -> None:
        """``count(item)``: the tensors and bytes ``item`` holds; ``None``: the caller counts (a slice's pieces)."""
        self._checkpoint = checkpoint
        self._inner = inner
        self._count = count

    def __iter__(self) -> TrackedReads[Item]:
        return self

    def __next__(self) -> Item:
        checkpoint = self._checkpoint
        if checkpoint.closed:
            self.close()
            raise CheckpointClosedError(f"{checkpoint.uri}: the checkpoint was closed while this iterator was open")
        started = time.perf_counter()
        item = next(self._inner)
        if self._count is not None:
            tensors, nbytes = self._count(item)
            checkpoint._counted(tensors, nbytes, nbytes, time.perf_counter() - started)
        if checkpoint.closed:  # closed from another thread during the read
            self.close()
            raise CheckpointClosedError(f"{checkpoint.uri}: the checkpoint was closed while this iterator was open")
        return item

    def close(self) -> None:
        """Stop reading (as a generator's ``close()``): readers stop, what was not handed out is released."""
        close = getattr(self._inner, "close", None)
        if close is not None:
            with contextlib.suppress(ValueError):  # running in another thread: it stops at its next step
                close()


def weight_items(item: tuple[str, torch.Tensor]) -> tuple[int, int]:
    return 1, item[1].nbytes


def layer_items(item: tuple[str, Mapping[str, torch.Tensor]]) -> tuple[int, int]:
    return len(item[1]), sum(tensor.nbytes for tensor in item[1].values())
