"""The ``streaming`` loader: bounded memory and completion order, for object stores (and any source)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import ClassVar

import torch

from weightstream.errors import InvalidOptionError
from weightstream.loaders.safetensors import plan_checkpoint
from weightstream.memory.devices import check_destination
from weightstream.options import LoadOptions
from weightstream.plan import LoadPlan
from weightstream.sources import store_for
from weightstream.streaming_reader import read_streaming, window_bytes


class StreamingLoader:
    """Reads safetensors checkpoints through a window of at most ``max_inflight_bytes``.

    Tensor bytes are fetched by ``threads`` concurrent range reads of up to ``chunk_bytes``, each
    landing in the memory of the tensors it carries; a tensor is yielded as soon as its bytes are
    complete. The default for ``s3://``, ``gs://`` and ``http(s)://`` URIs; it reads local files too.
    On a CUDA device the bytes pass through the pinned staging ring, which must fit the window.
    """

    name: ClassVar[str] = "streaming"

    def plan(self, uri: str, opts: LoadOptions) -> LoadPlan:
        if opts.zero_copy:
            raise InvalidOptionError("zero_copy maps whole files: the streaming loader reads into memory of its own")
        plan = plan_checkpoint(uri, opts)
        window = window_bytes(plan, opts)
        staging = opts.staging_slots * opts.staging_slot_bytes
        if torch.device(opts.device).type == "cuda" and staging > window:
            raise InvalidOptionError(
                f"staging_slots x staging_slot_bytes = {staging} bytes of pinned staging exceed max_inflight_bytes={window}"
            )
        return plan

    def iter_weights(self, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        pinned = check_destination(opts.device, opts.pin_memory)
        return _stream_and_close(plan, opts, pinned)


def _stream_and_close(plan: LoadPlan, opts: LoadOptions, pinned: bool) -> Iterator[tuple[str, torch.Tensor]]:
    with contextlib.closing(store_for(plan.uri, opts.storage_options, opts.retry_policy())) as store:
        if torch.device(opts.device).type == "cuda":
            from weightstream.memory.cuda import CudaStaging
            from weightstream.staged_reader import read_staged

            yield from read_staged(store, plan, opts, CudaStaging(opts.device))
        else:
            yield from read_streaming(store, plan, opts, pinned=pinned)
