"""The ``distributed`` loader: the ranks of a process group each read a share, and share it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

import torch

from weightstream.errors import InvalidOptionError
from weightstream.loaders.safetensors import plan_checkpoint
from weightstream.memory.devices import check_destination
from weightstream.options import LoadOptions
from weightstream.planning.plan import LoadPlan
from weightstream.readers.distributed import DistributedStats, read_distributed, told_to_peers
from weightstream.readers.parallel import read_tensors
from weightstream.sources import Store

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


class DistributedLoader:
    """Every rank of ``process_group`` (default: the default group) calls it on the same checkpoint:
    each reads about 1/N of the bytes from storage (local files on a shared filesystem, S3, GCS,
    HTTP), and the chunks are broadcast so that every rank ends with every tensor, bit-identical to
    a single-process load. CPU destinations over gloo, CUDA ones (each rank its own device, through
    the pinned staging ring) over NCCL."""

    name: ClassVar[str] = "distributed"
    options: ClassVar[type] = DistributedOptions

    def check(self, opts: LoadOptions) -> None:
        if opts.zero_copy is True:
            raise InvalidOptionError("zero_copy=True: maps whole files; each rank here reads only its share")
        check_destination(opts.device, opts.pin_memory)
        _group_of(opts)

    def plan(self, store: Store, uri: str, opts: LoadOptions) -> LoadPlan:
        group = _group_of(opts)
        device = torch.device(opts.device) if torch.device(opts.device).type == "cuda" else torch.device("cpu")
        with told_to_peers(group, device, uri, "planning"):  # a rank that cannot plan (a missing file) tells the others
            return plan_checkpoint(store, uri, opts)

    def iter_weights(self, store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        pinned = check_destination(opts.device, opts.pin_memory)
        return _read(store, plan, opts, _group_of(opts), pinned)


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


def _every_rank_attached(store: Store, opts: LoadOptions, group: ProcessGroup | None) -> bool:
    """Whether every rank of ``group`` reads through a node cache (a collective: every rank asks, so that ranks
    that do and ranks that do not still agree on sharing the load)."""
    import torch.distributed as dist

    device = torch.device(opts.device) if torch.device(opts.device).type == "cuda" else torch.device("cpu")
    attached = torch.tensor([int(getattr(store, "shares_memory", False))], dtype=torch.int32, device=device)
    dist.all_reduce(attached, op=dist.ReduceOp.MIN, group=group)
    return bool(attached.item())


def _read(
    store: Store, plan: LoadPlan, opts: LoadOptions, group: ProcessGroup | None, pinned: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    stats = opts.own(DistributedOptions).stats
    if _every_rank_attached(store, opts, group):
        # Every rank reads through its node's cache: the bytes are in shared memory on each node already (one read
        # from storage, one copy, per node); sharing them over the group would only make a copy per rank.
        yield from read_tensors(store, plan, opts)
        return
    if torch.device(opts.device).type == "cuda":
        from weightstream.memory.cuda import CudaStaging

        yield from read_distributed(store, plan, opts, group, staging=CudaStaging(opts.device), stats=stats)
    else:
        yield from read_distributed(store, plan, opts, group, pinned=pinned, stats=stats)
