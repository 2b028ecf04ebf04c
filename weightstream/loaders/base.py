"""The loader contract every registry entry implements."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Protocol, runtime_checkable

import torch

from weightstream.options import LoadOptions
from weightstream.planning.plan import LoadPlan


@runtime_checkable
class Loader(Protocol):
    """A loading strategy, registered under ``name``.

    ``plan`` reads only what it must (headers, indexes) and rejects any option it cannot
    honour before a byte of tensor data is read. ``iter_weights`` yields ``(name, tensor)``
    pairs and, on any error, stops its workers and releases its memory before raising.
    """

    name: ClassVar[str]

    def plan(self, uri: str, opts: LoadOptions) -> LoadPlan:
        """Resolve ``uri`` into the tensors to read."""

    def iter_weights(self, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        """Read the plan's tensors and yield them as they complete."""
