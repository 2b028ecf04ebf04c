"""The ``distributed`` loader: the ranks of a process group each read a share, and share it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

import torch

from weightstream.errors import InvalidOptionError
from weightstream.options import LoadOptions
from weightstream.planning.plan import LoadPlan
from weightstream.planning.planner import read_plan
from weightstream.readers.destination import ALL_ROUTES, COPYING_ROUTES, Destination, Route, choose_destination
from weightstream.readers.distributed import DistributedStats, read_distributed, told_to_peers
from weightstream.readers.parallel import read_tensors
from weightstream.sources import Store
from weightstream.sources.base import SharedMemory

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclasses.dataclass(frozen=True)
class DistributedOptions:
    """The ``distributed`` loader's own options."""

    process_group: ProcessGroup | None = None
    """The ``torch.distributed`` process group whose ranks share the load (gloo for CPU tensors, NCCL
    for CUDA ones). Default ``None``: the default group."""

    stats: DistributedStats | None = None
    """A ``weightstream.DistributedStats`` to fill in (bytes read from storage, received, sent; seconds
    waiting for reads and sharing). Default ``None``."""

    def __post_init__(self) -> None:
        if self.stats is not None and not isinstance(self.stats, DistributedStats):
            raise InvalidOptionError(f"stats must be a weightstream.DistributedStats, got {type(self.stats).__name__}")


NAME = "distributed"


class DistributedLoader:
    """Every rank of ``process_group`` (default: the default group) calls it on the same checkpoint:
    each reads about 1/N of the bytes from storage (local files on a shared filesystem, S3, GCS,
    HTTP), and the chunks are broadcast so that every rank ends with every tensor, bit-identical to
    a single-process load. CPU destinations over gloo, CUDA ones (each rank its own device, through
    the pinned staging ring) over NCCL."""

    name: ClassVar[str] = NAME
    options: ClassVar[type] = DistributedOptions

    def check(self, opts: LoadOptions) -> None:
        """Nothing before the store is known: the destination, then the process group, are checked at plan time."""

    def plan(self, store: Store, uri: str, opts: LoadOptions) -> LoadPlan:
        device = choose_destination(store, uri, opts, self.name, COPYING_ROUTES).device
        group = _group_of(opts)
        with told_to_peers(group, device, uri, "planning"):  # a rank that cannot plan (a missing file) tells the others
            return read_plan(store, uri, opts.wants, opts.required)

    def iter_weights(self, store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        return _read(
            store, plan, opts, _group_of(opts), choose_destination(store, plan.uri, opts, self.name, COPYING_ROUTES)
        )


TRANSPORTS = {"cpu": "gloo", "cuda": "nccl"}
"""The backend that shares tensors on each kind of device."""


def _group_of(opts: LoadOptions) -> ProcessGroup | None:
    """The process group of the load (None: the default group), once it is known to be usable."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidOptionError(
            "the distributed loader needs torch.distributed initialised (init_process_group) on every rank"
        )
    kind = torch.device(opts.device).type
    group = opts.own(DistributedOptions).process_group
    backend = dist.get_backend(group)  # "gloo", "nccl", or per device: "cpu:gloo,cuda:nccl"
    if TRANSPORTS[kind] not in {part.rsplit(":", 1)[-1] for part in backend.split(",")}:
        raise InvalidOptionError(
            f"the distributed loader shares {kind.upper()} tensors over {TRANSPORTS[kind]}; the process group's "
            f"backend is {backend!r}"
        )
    return group


def _every_rank_attached(store: Store, device: torch.device, group: ProcessGroup | None) -> bool:
    """Whether every rank of ``group`` reads through a node cache (a collective: every rank asks, so that ranks
    that do and ranks that do not still agree on sharing the load)."""
    import torch.distributed as dist

    attached = torch.tensor([int(isinstance(store, SharedMemory))], dtype=torch.int32, device=device)
    dist.all_reduce(attached, op=dist.ReduceOp.MIN, group=group)
    return bool(attached.item())


def _read(
    store: Store, plan: LoadPlan, opts: LoadOptions, group: ProcessGroup | None, destination: Destination
) -> Iterator[tuple[str, torch.Tensor]]:
    stats = opts.own(DistributedOptions).stats
    if _every_rank_attached(store, destination.device, group):
        # Every rank reads through its node's cache: the bytes are in shared memory on each node already (one read
        # from storage, one copy, per node); sharing them over the group would only make a copy per rank. Views of
        # that memory are then a route too.
        yield from read_tensors(store, plan, opts, choose_destination(store, plan.uri, opts, NAME, ALL_ROUTES))
        return
    if destination.route is Route.STAGED:
        from weightstream.memory.cuda import CudaStaging

        yield from read_distributed(store, plan, opts, group, staging=CudaStaging(destination.device), stats=stats)
    else:
        yield from read_distributed(store, plan, opts, group, pinned=destination.pinned, stats=stats)
