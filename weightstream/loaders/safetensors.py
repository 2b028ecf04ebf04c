"""The ``safetensors`` loader: local files (or any store), parallel positional reads into owned memory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch

from weightstream.errors import InvalidOptionError
from weightstream.memory.devices import check_destination
from weightstream.options import LoadOptions
from weightstream.planning.checkpoint import CheckpointFiles, read_plan
from weightstream.planning.plan import LoadPlan
from weightstream.readers.parallel import read_tensors
from weightstream.sources import Store
from weightstream.sources.local.file import LocalStore


class SafetensorsLoader:
    """Reads a safetensors file, a Hugging Face sharded directory, or a directory of shards.

    Every byte is read once, in requests of up to ``chunk_bytes``, by ``threads`` reader
    threads, straight into one caller-owned buffer per file (pinned with ``pin_memory``);
    tensors are views of it. For a CUDA device the reads land in a ring of pinned staging
    slots that a dedicated stream copies to one device buffer per file.
    """

    name: ClassVar[str] = "safetensors"

    def check(self, opts: LoadOptions) -> None:
        check_destination(opts.device, opts.pin_memory)

    def plan(self, store: Store, uri: str, opts: LoadOptions) -> LoadPlan:
        return plan_checkpoint(store, uri, opts)

    def iter_weights(self, store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        check_destination(opts.device, opts.pin_memory)
        return read_tensors(store, plan, opts)


def plan_checkpoint(store: Store, uri: str, opts: LoadOptions, checkpoint: CheckpointFiles | None = None) -> LoadPlan:
    """The plan of the safetensors checkpoint at ``uri`` (or of ``checkpoint``'s files) in ``store``
    (local or remote), options checked first."""
    if not isinstance(store, LocalStore):
        _check_remote_options(store, uri, opts)
    required = opts.filter if opts.filter is not None and not callable(opts.filter) else ()
    return read_plan(store, uri, opts.wants, required, checkpoint)


def _check_remote_options(store: Store, uri: str, opts: LoadOptions) -> None:
    """Options that only mean something for local files are refused for objects, not ignored."""
    for name, meaningless in (
        ("direct_io", opts.direct_io is True),
        ("zero_copy", opts.zero_copy is True and not hasattr(store, "mapped")),
        ("gds", opts.gds is True),
    ):
        if meaningless:
            raise InvalidOptionError(f"{name}={getattr(opts, name)!r}: {uri} is an object, not a local file")
