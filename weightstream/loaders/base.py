"""The loader contract every registry entry implements."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Protocol, runtime_checkable

import torch

from weightstream.options import LoadOptions
from weightstream.planning.plan import LoadPlan
from weightstream.sources.base import Store


@runtime_checkable
class Loader(Protocol):
    """A loading strategy, registered under ``name``.

    The caller (a :class:`weightstream.Checkpoint`) opens one store for the checkpoint and hands
    it to every call; the loader reads through it and never closes it. ``check`` refuses any
    option the loader cannot honour, before any I/O. ``plan`` reads only what it must (headers,
    indexes). ``iter_weights`` yields ``(name, tensor)`` pairs of a plan it made (or a part of one:
    the same files, fewer tensors) and, on any error, stops its workers and releases its memory
    before raising.

    A loader with options of its own declares them as a frozen dataclass in an ``options`` class
    attribute (``options: ClassVar[type] = MyOptions``; optional): ``weightstream.open`` builds it from
    the caller's keyword arguments before any I/O, and the loader reads it with ``opts.own(MyOptions)``.
    """

    name: ClassVar[str]

    def check(self, opts: LoadOptions) -> None:
        """Raise ``InvalidOptionError`` for an option this loader cannot honour; no I/O."""

    def plan(self, store: Store, uri: str, opts: LoadOptions) -> LoadPlan:
        """Resolve ``uri`` into the tensors to read."""

    def iter_weights(self, store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        """Read the plan's tensors and yield them as they complete."""
