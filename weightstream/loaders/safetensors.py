"""The ``safetensors`` loader: local files (or any store), parallel positional reads into owned memory."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import ClassVar

import torch

from weightstream.errors import InvalidOptionError
from weightstream.formats.checkpoint import read_plan
from weightstream.memory.devices import check_destination
from weightstream.options import LoadOptions
from weightstream.plan import LoadPlan
from weightstream.reader import read_tensors
from weightstream.sources import Store, store_for
from weightstream.sources.local import LocalStore


class SafetensorsLoader:
    """Reads a safetensors file, a Hugging Face sharded directory, or a directory of shards.

    Every byte is read once, in requests of up to ``chunk_bytes``, by ``threads`` reader
    threads, straight into one caller-owned buffer per file (pinned with ``pin_memory``);
    tensors are views of it. For a CUDA device the reads land in a ring of pinned staging
    slots that a dedicated stream copies to one device buffer per file.
    """

    name: ClassVar[str] = "safetensors"

    def plan(self, uri: str, opts: LoadOptions) -> LoadPlan:
        if opts.max_inflight_bytes is not None:
            raise InvalidOptionError(
                f"max_inflight_bytes: the {self.name} loader holds the whole checkpoint; "
                f"use format='streaming' for a bounded window"
            )
        return plan_checkpoint(uri, opts)

    def iter_weights(self, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        check_destination(opts.device, opts.pin_memory)
        return _read_and_close(store_for(plan.uri, opts.storage_options, opts.retry_policy()), plan, opts)


def plan_checkpoint(uri: str, opts: LoadOptions) -> LoadPlan:
    """The plan of the safetensors checkpoint at ``uri`` (local or an object store), options checked first."""
    check_destination(opts.device, opts.pin_memory)
    with contextlib.closing(store_for(uri, opts.storage_options, opts.retry_policy())) as store:
        if not isinstance(store, LocalStore):
            _check_remote_options(uri, opts)
        required = opts.filter if opts.filter is not None and not callable(opts.filter) else ()
        return read_plan(store, uri, opts.wants, required)


def _read_and_close(store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
    with contextlib.closing(store):
        yield from read_tensors(store, plan, opts)


def _check_remote_options(uri: str, opts: LoadOptions) -> None:
    """Options that only mean something for local files are refused for objects, not ignored."""
    for name, meaningless in (("direct_io", opts.direct_io is True), ("zero_copy", opts.zero_copy), ("gds", opts.gds is True)):
        if meaningless:
            raise InvalidOptionError(f"{name}={getattr(opts, name)!r}: {uri} is an object, not a local file")
