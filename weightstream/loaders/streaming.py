"""The ``streaming`` loader: bounded memory and completion order, for object stores (and any source)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import torch

from weightstream.errors import InvalidOptionError
from weightstream.loaders.safetensors import plan_checkpoint
from weightstream.memory.devices import check_destination
from weightstream.options import LoadOptions
from weightstream.planning.plan import LoadPlan
from weightstream.readers.streaming import read_streaming, window_bytes
from weightstream.sources import Store


class StreamingLoader:
    """Reads safetensors checkpoints through a window of at most ``max_inflight_bytes``.

    Tensor bytes are fetched by ``threads`` concurrent range reads of up to ``chunk_bytes``, each
    landing in the memory of the tensors it carries; a tensor is yielded as soon as its bytes are
    complete. The default for ``s3://``, ``gs://`` and ``http(s)://`` URIs; it reads local files too.
    On a CUDA device the bytes pass through the pinned staging ring, which must fit the window.
    """

    name: ClassVar[str] = "streaming"

    def check(self, opts: LoadOptions) -> None:
        if opts.zero_copy:
            raise InvalidOptionError("zero_copy maps whole files: the streaming loader reads into memory of its own")
        opts.refuse_foreign(self.name)
        check_destination(opts.device, opts.pin_memory)

    def plan(self, store: Store, uri: str, opts: LoadOptions) -> LoadPlan:
        return _fits_window(plan_checkpoint(store, uri, opts), opts)

    def iter_weights(self, store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        pinned = check_destination(opts.device, opts.pin_memory)
        return _stream(store, plan, opts, pinned)


def _fits_window(plan: LoadPlan, opts: LoadOptions) -> LoadPlan:
    """``plan``, once its largest tensor and (on a GPU) the staging ring are known to fit the window."""
    window = window_bytes(plan, opts)
    staging = opts.staging_slots * opts.staging_slot_bytes
    if torch.device(opts.device).type == "cuda" and staging > window:
        raise InvalidOptionError(
            f"staging_slots x staging_slot_bytes = {staging} bytes of pinned staging exceed max_inflight_bytes={window}"
        )
    return plan


def _stream(store: Store, plan: LoadPlan, opts: LoadOptions, pinned: bool) -> Iterator[tuple[str, torch.Tensor]]:
    if torch.device(opts.device).type == "cuda":
        from weightstream.memory.cuda import CudaStaging
        from weightstream.readers.staged import read_staged

        yield from read_staged(store, plan, opts, CudaStaging(opts.device))
    else:
        yield from read_streaming(store, plan, opts, pinned=pinned)
