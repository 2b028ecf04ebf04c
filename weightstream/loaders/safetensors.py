"""The ``safetensors`` loader: local files (or any store), parallel positional reads into owned memory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch

from weightstream.errors import InvalidOptionError
from weightstream.formats.checkpoint import read_plan
from weightstream.memory.devices import check_destination
from weightstream.options import LoadOptions
from weightstream.plan import LoadPlan
from weightstream.reader import read_tensors
from weightstream.sources import store_for


class SafetensorsLoader:
    """Reads a safetensors file, a Hugging Face sharded directory, or a directory of shards.

    Every byte is read once, in requests of up to ``chunk_bytes``, by ``threads`` reader
    threads, straight into one caller-owned buffer per file; tensors are views of it.
    """

    name: ClassVar[str] = "safetensors"

    def plan(self, uri: str, opts: LoadOptions) -> LoadPlan:
        _check_device(opts)
        required = opts.filter if opts.filter is not None and not callable(opts.filter) else ()
        return read_plan(store_for(uri), uri, opts.wants, required)

    def iter_weights(self, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        _check_device(opts)
        return read_tensors(store_for(plan.uri), plan, opts)


def _check_device(opts: LoadOptions) -> None:
    pinned = check_destination(opts.device, opts.pin_memory)
    if torch.device(opts.device).type != "cpu":
        raise InvalidOptionError(f"device {opts.device!r}: the safetensors loader supports only 'cpu' in this version")
    if pinned:
        raise InvalidOptionError("pin_memory: the safetensors loader does not pin memory in this version")
