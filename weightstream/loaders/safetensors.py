"""The ``safetensors`` loader: local files (or any store), parallel positional reads into owned memory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch

from weightstream.options import LoadOptions
from weightstream.planning.plan import LoadPlan
from weightstream.planning.planner import read_plan
from weightstream.readers.destination import ALL_ROUTES, choose_destination
from weightstream.readers.parallel import read_tensors
from weightstream.sources import Store


class SafetensorsLoader:
    """Reads a safetensors file, a Hugging Face sharded directory, or a directory of shards.

    Every byte is read once, in requests of up to ``chunk_bytes``, by ``threads`` reader
    threads, straight into one caller-owned buffer per file (pinned with ``pin_memory``);
    tensors are views of it. For a CUDA device the reads land in a ring of pinned staging
    slots that a dedicated stream copies to one device buffer per file, or go straight there
    through cuFile (``gds``). With ``zero_copy`` tensors view the files' mappings.
    """

    name: ClassVar[str] = "safetensors"

    def check(self, opts: LoadOptions) -> None:
        """Nothing beyond the core options: every route is this loader's."""

    def plan(self, store: Store, uri: str, opts: LoadOptions) -> LoadPlan:
        choose_destination(store, uri, opts, self.name, ALL_ROUTES)  # what cannot be honoured is refused before a read
        return read_plan(store, uri, opts.wants, opts.required)

    def iter_weights(self, store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        return read_tensors(store, plan, opts, choose_destination(store, plan.uri, opts, self.name, ALL_ROUTES))
