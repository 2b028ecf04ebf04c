"""The ``streaming`` loader: bounded memory and completion order, for object stores (and any source)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import ClassVar

import torch

from weightstream.errors import InvalidOptionError
from weightstream.options import LoadOptions, is_int
from weightstream.planning.plan import LoadPlan
from weightstream.planning.planner import read_plan
from weightstream.readers.destination import COPYING_ROUTES, Destination, Route, choose_destination
from weightstream.readers.streaming import read_streaming, window_bytes
from weightstream.sources import Store


@dataclasses.dataclass(frozen=True)
class StreamingOptions:
    """The ``streaming`` loader's own options."""

    max_inflight_bytes: int | None = None
    """Bytes of destination memory held at once: tensors being read plus tensors read but not yet
    yielded (yielded ones belong to the caller). At least one read request (``chunk_bytes``) and,
    checked at plan time, the largest selected tensor. Default ``None``: 1 GiB, or the largest
    selected tensor if bigger. Other loaders hold the whole checkpoint and refuse it (their CUDA
    destinations still go through a 1 GiB device window)."""

    def __post_init__(self) -> None:
        if self.max_inflight_bytes is not None and (not is_int(self.max_inflight_bytes) or self.max_inflight_bytes < 1):
            raise InvalidOptionError(
                f"max_inflight_bytes must be a positive integer or None, got {self.max_inflight_bytes!r}"
            )


class StreamingLoader:
    """Reads safetensors checkpoints through a window of at most ``max_inflight_bytes``.

    Tensor bytes are fetched by ``threads`` concurrent range reads of up to ``chunk_bytes``, each
    landing in the memory of the tensors it carries; a tensor is yielded as soon as its bytes are
    complete. The default for ``s3://``, ``gs://`` and ``http(s)://`` URIs; it reads local files too.
    On a CUDA device the bytes pass through the pinned staging ring, which must fit the window.
    """

    name: ClassVar[str] = "streaming"
    options: ClassVar[type] = StreamingOptions

    def check(self, opts: LoadOptions) -> None:
        window = opts.own(StreamingOptions).max_inflight_bytes
        if window is not None and opts.chunk_bytes is not None and window < opts.chunk_bytes:
            raise InvalidOptionError(
                f"max_inflight_bytes={window} is less than chunk_bytes={opts.chunk_bytes}: not even one read request "
                "would fit"
            )

    def plan(self, store: Store, uri: str, opts: LoadOptions) -> LoadPlan:
        destination = choose_destination(store, uri, opts, self.name, COPYING_ROUTES)
        return _fits_window(read_plan(store, uri, opts.wants, opts.required), opts, destination)

    def iter_weights(self, store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        return _stream(store, plan, opts, choose_destination(store, plan.uri, opts, self.name, COPYING_ROUTES))


def _fits_window(plan: LoadPlan, opts: LoadOptions, destination: Destination) -> LoadPlan:
    """``plan``, once its largest tensor and (on a GPU) the staging ring are known to fit the window."""
    window = window_bytes(plan, opts, opts.own(StreamingOptions).max_inflight_bytes)
    staging = opts.staging_slots * opts.staging_slot_bytes
    if destination.route is Route.STAGED and staging > window:
        raise InvalidOptionError(
            f"staging_slots x staging_slot_bytes = {staging} bytes of pinned staging exceed max_inflight_bytes={window}"
        )
    return plan


def _stream(
    store: Store, plan: LoadPlan, opts: LoadOptions, destination: Destination
) -> Iterator[tuple[str, torch.Tensor]]:
    window = opts.own(StreamingOptions).max_inflight_bytes
    if destination.route is Route.STAGED:
        from weightstream.memory.cuda import CudaStaging
        from weightstream.readers.staged import read_staged

        yield from read_staged(store, plan, opts, CudaStaging(destination.device), window)
    else:
        yield from read_streaming(store, plan, opts, pinned=destination.pinned, max_inflight_bytes=window)
