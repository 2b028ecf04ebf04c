"""The ``safetensors`` loader: local files (or any store), parallel positional reads into owned memory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch

from weightstream.formats.checkpoint import read_plan
from weightstream.memory.devices import check_destination
from weightstream.options import LoadOptions
from weightstream.plan import LoadPlan
from weightstream.reader import read_tensors
from weightstream.sources import store_for


class SafetensorsLoader:
    """Reads a safetensors file, a Hugging Face sharded directory, or a directory of shards.

    Every byte is read once, in requests of up to ``chunk_bytes``, by ``threads`` reader
    threads, straight into one caller-owned buffer per file (pinned with ``pin_memory``);
    tensors are views of it. For a CUDA device the reads land in a ring of pinned staging
    slots that a dedicated stream copies to one device buffer per file.
    """

    name: ClassVar[str] = "safetensors"

    def plan(self, uri: str, opts: LoadOptions) -> LoadPlan:
        check_destination(opts.device, opts.pin_memory)
        required = opts.filter if opts.filter is not None and not callable(opts.filter) else ()
        return read_plan(store_for(uri), uri, opts.wants, required)

    def iter_weights(self, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        check_destination(opts.device, opts.pin_memory)
        return read_tensors(store_for(plan.uri), plan, opts)
