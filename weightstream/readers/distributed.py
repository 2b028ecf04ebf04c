"""The distributed reader: each rank reads a share of the checkpoint, and every rank gets all of it.

The plan's read requests (chunks of up to ``chunk_bytes``, laid out as the host reader lays out
each file) are owned by ranks: each chunk by the rank with the fewest bytes so far, so the shares
differ by at most one chunk and every rank computes the same assignment. All ranks walk the
chunks in order: one ``all_reduce(MAX)`` of a status integer, then a ``broadcast`` from the chunk's
owner that lands the bytes in place on the others. Meanwhile each rank's reader threads prepare
the next ``reader_threads`` chunks: its own are read straight into the destination memory, its
peers' have their pages faulted in before they arrive (receiving into fresh pages is several times
slower: the kernel faults them one by one as it copies from the socket). Preparing further ahead
only takes CPU from the sharing (4 GiB, 2 ranks on 2 cores: 7.5-15 s unbounded, 5.0-6.0 s bounded).
A tensor is yielded once its chunks have arrived.

Failures: a rank whose read fails, or whose caller stops iterating, contributes 1 to the next
status, and every other rank raises ``PeerError`` at once; a killed rank's peers see its
connections reset; a rank that hangs is bounded by the process group's timeout. Every rank first
checks that all planned the same load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch

from weightstream.errors import PeerError
from weightstream.memory.devices import check_fits
from weightstream.memory.host import HostArena
from weightstream.memory.ring import CopyHandle
from weightstream.options import LoadOptions
from weightstream.planning.plan import FileLayout, LoadPlan, ReadRequest, layout_file
from weightstream.readers.files import FileHandles
from weightstream.readers.staged import Staging, stage_request, staging_ring
from weightstream.readers.tasks import (
    Waiting,
    buffer_tensor,
    read_into_arena,
    start_readers,
    wants_huge_pages,
)
from weightstream.sources import REMOTE_SCHEMES
from weightstream.sources.base import Source, Store

SHARE_CHUNK_BYTES = 64 << 20
"""Default chunk (read request and broadcast) size: each chunk costs two collectives, whose latency
on a busy machine is milliseconds (measured: a 4 GiB share took 28.5 s in 8 MiB chunks, 17.0 s in 64 MiB)."""


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One read request of one file, and the rank (in the group) that reads it from storage."""

    file: int
    request: int
    nbytes: int
    owner: int


@dataclasses.dataclass
class DistributedStats:
    """What one rank's load did; pass one as ``stats=`` and read it afterwards.

    Example:
        >>> stats = DistributedStats()
        >>> stats.read_bytes, stats.received_bytes
        (0, 0)
    """

    read_bytes: int = 0
    """Bytes this rank read from storage."""
    received_bytes: int = 0
    """Bytes this rank received from its peers."""
    sent_bytes: int = 0
    """Bytes of its own reads this rank broadcast."""
    read_wait_seconds: float = 0.0
    """Time spent waiting for this rank's own reads to land."""
    fault_wait_seconds: float = 0.0
    """Time spent waiting for the pages of peers' chunks to be faulted in before they arrive."""
    share_seconds: float = 0.0
    """Time spent in the status and broadcast collectives."""


def assign_chunks(layouts: list[FileLayout], world_size: int) -> list[Chunk]:
    """Every request of every file, in file order, each owned by the rank with the fewest bytes so far.

    Example:
        >>> import torch
        >>> from weightstream.planning.plan import TensorSpec
        >>> layout = layout_file([TensorSpec("w", torch.uint8, (5 * 4096,), "f", 0, 5 * 4096)], 4096)
        >>> [chunk.owner for chunk in assign_chunks([layout], 2)]
        [0, 1, 0, 1, 0]
    """
    load = [0] * world_size
    chunks = []
    for file_number, layout in enumerate(layouts):
        for request_number, request in enumerate(layout.requests):
            owner = min(range(world_size), key=lambda rank: (load[rank], rank))
            load[owner] += request.nbytes
            chunks.append(Chunk(file_number, request_number, request.nbytes, owner))
    return chunks


def read_distributed(
    store: Store,
    plan: LoadPlan,
    opts: LoadOptions,
    group: Any,
    *,
    pinned: bool = False,
    staging: Staging | None = None,
    stats: DistributedStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of ``plan`` on this rank of ``group``, having read only this rank's share.

    Tensors land in host memory (``pinned`` or not), or with ``staging`` in its memory (a GPU's
    for ``CudaStaging``, shared over NCCL), this rank's own chunks through its staging slots.

    Example:
        >>> for name, tensor in read_distributed(store, plan, LoadOptions(), None):  # doctest: +SKIP
        ...     model[name].copy_(tensor)
    """
    import torch.distributed as dist

    stats = stats if stats is not None else DistributedStats()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    chunk_bytes = (
        opts.chunk_bytes if opts.chunk_bytes is not None else max(SHARE_CHUNK_BYTES, opts.request_bytes(plan.uri))
    )
    if staging is not None:
        chunk_bytes = min(chunk_bytes, opts.staging_slot_bytes)
    device = staging.device if staging is not None else torch.device("cpu")
    with told_to_peers(group, device, plan.uri, "setting up the load of"):
        check_fits(plan.total_bytes, opts.device, plan.uri)
        layouts = [layout_file(plan.tensors_of(spec.path), chunk_bytes) for spec in plan.files]
        layouts = [layout for layout in layouts if layout.tensor_offsets]
        chunks = assign_chunks(layouts, world_size)
    _check_same_plan(plan, chunks, group, device)
    files = {spec.path: spec for spec in plan.files}
    with contextlib.ExitStack() as cleanup:
        peers = _Peers(group, device)
        # Registered first, so it runs last (after the readers stopped), and before anything here can fail:
        # a rank failing to open its files or to allocate tells its peers in their first status round.
        cleanup.callback(peers.leave)
        handles = cleanup.enter_context(FileHandles(store, opts))
        sources = [handles.source(files[layout.file]) for layout in layouts]
        landing = (
            _HostLanding(layouts, sources, opts, pinned) if staging is None else _StagedLanding(layouts, staging, opts)
        )
        cleanup.callback(landing.close)  # runs after the readers stopped writing
        readers, stop, futures = start_readers(cleanup, opts)
        ahead: dict[
            int, Future
        ] = {}  # chunk number -> this rank's read of it, or the preparing of a peer's chunk's memory

        def prepare(number: int) -> None:
            if number < len(chunks):
                chunk = chunks[number]
                request = layouts[chunk.file].requests[chunk.request]
                task = landing.own if chunk.owner == rank else landing.peer
                ahead[number] = readers.submit(task, sources[chunk.file], request, chunk.file, stop)
                futures[ahead[number]] = number

        for number in range(opts.reader_threads):
            prepare(number)
        waiting = [Waiting(layout) for layout in layouts]
        for file_number, tensors in enumerate(waiting):
            for tensor_number in tensors.ready_without_reads():
                yield buffer_tensor(layouts[file_number], landing.buffers[file_number], tensor_number)
        for number, chunk in enumerate(chunks):
            started = time.perf_counter()
            landing.landed(ahead.pop(number).result())
            prepare(number + opts.reader_threads)
            if chunk.owner == rank:
                stats.read_wait_seconds += time.perf_counter() - started
                stats.read_bytes += chunk.nbytes
            else:
                stats.fault_wait_seconds += time.perf_counter() - started
            request = layouts[chunk.file].requests[chunk.request]
            started = time.perf_counter()
            peers.share(
                landing.buffers[chunk.file][request.dest_offset : request.dest_offset + request.nbytes],
                chunk.owner,
                number,
                len(chunks),
                plan.uri,
            )
            stats.share_seconds += time.perf_counter() - started
            if chunk.owner == rank:
                stats.sent_bytes += chunk.nbytes
            else:
                stats.received_bytes += chunk.nbytes
            for tensor_number in waiting[chunk.file].request_done(chunk.request):
                yield buffer_tensor(layouts[chunk.file], landing.buffers[chunk.file], tensor_number)
        peers.finished = True


class _HostLanding:
    """Chunks land in one host arena per file: this rank's read in place, its peers' pages faulted
    in first, which is several times faster than the kernel faulting them one by one as it copies
    from the socket (measured: a 4 GiB two-rank share at 0.83 GB/s prefaulted, 0.23 GB/s not)."""

    def __init__(self, layouts: list[FileLayout], sources: list[Source], opts: LoadOptions, pinned: bool) -> None:
        self._opts = opts
        self._arenas = [
            HostArena(layout.buffer_bytes, huge_pages=wants_huge_pages(source, opts), pinned=pinned)
            for layout, source in zip(layouts, sources, strict=True)
        ]
        self.buffers = [arena.bytes for arena in self._arenas]
        """Each file's destination memory, as uint8 tensors."""

    def own(self, source: Source, request: ReadRequest, file: int, stop: threading.Event) -> None:
        read_into_arena(source, request, self._arenas[file], stop, self._opts)

    def peer(self, source: Source, request: ReadRequest, file: int, stop: threading.Event) -> None:
        if not stop.is_set():
            self._arenas[file].populate(request.dest_offset, request.nbytes)

    def landed(self, result: None) -> None:
        """Nothing to wait for: a host read is in place once its task is done."""

    def close(self) -> None:
        self._arenas.clear()
        self.buffers.clear()


class _StagedLanding:
    """Chunks land in ``staging``'s memory: this rank's through its ring of slots (a copy launched per
    chunk, waited for before the chunk is shared), its peers' straight from the transport."""

    def __init__(self, layouts: list[FileLayout], staging: Staging, opts: LoadOptions) -> None:
        self._opts = opts
        self.buffers = [staging.allocate(layout.buffer_bytes, layout.file) for layout in layouts]
        """Each file's destination memory, as uint8 tensors."""
        try:
            self._ring = staging_ring(staging, opts)
        except BaseException:
            self.buffers.clear()
            raise

    def own(self, source: Source, request: ReadRequest, file: int, stop: threading.Event) -> CopyHandle | None:
        return stage_request(source, request, self.buffers[file], self._ring, stop, self._opts)

    def peer(self, source: Source, request: ReadRequest, file: int, stop: threading.Event) -> None:
        """Nothing to prepare: the transport writes device memory itself."""

    def landed(self, handle: CopyHandle | None) -> None:
        if handle is not None:
            self._ring.wait(handle)

    def close(self) -> None:
        try:
            self._ring.close()
        finally:
            self.buffers.clear()


class _Peers:
    """The collectives of one load: a status round and a broadcast per chunk, and leaving early."""

    def __init__(self, group: Any, device: torch.device) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._status = torch.zeros(1, dtype=torch.int32, device=device)
        self._alone = dist.get_world_size(group) == 1
        """A group of one has no peer to tell or share with: no collective runs (gloo's worker thread would
        keep the last broadcast's view, and so the whole file's arena, until it next runs)."""
        self.finished = False
        self._between_chunks = True  # the peers' next collective is a status round

    def share(self, view: torch.Tensor, owner: int, number: int, count: int, uri: str) -> None:
        """The status round, then ``view`` broadcast from ``owner`` (its bytes land in place here)."""
        if self._alone:
            return
        self._status.fill_(0)
        self._between_chunks = False
        try:
            self._dist.all_reduce(self._status, op=self._dist.ReduceOp.MAX, group=self._group)
            if self._status.item():
                self.finished = True  # a peer left: no collective follows
                raise PeerError(
                    f"another rank stopped while loading {uri} (before chunk {number} of {count}); its own error says "
                    "why"
                )
            self._dist.broadcast(
                view,
                src=self._dist.get_global_rank(self._group, owner) if self._group is not None else owner,
                group=self._group,
            )
        except RuntimeError as error:
            if isinstance(error, PeerError):
                raise
            self.finished = True
            raise PeerError(
                f"lost a peer while loading {uri} (chunk {number} of {count}): {str(error).splitlines()[0]}"
            ) from None
        self._between_chunks = True

    def leave(self) -> None:
        """Leaving before the end: tell the peers in the status round they wait in (when they wait in one)."""
        if self._alone or self.finished or not self._between_chunks:
            return
        self._status.fill_(1)
        with contextlib.suppress(RuntimeError):  # the peers may be gone already
            self._dist.all_reduce(self._status, op=self._dist.ReduceOp.MAX, group=self._group)


@contextlib.contextmanager
def told_to_peers(group: Any, device: torch.device, uri: str, doing: str) -> Iterator[None]:
    """Run a phase every rank runs before its next collective, then agree on its outcome with one
    ``all_reduce``: a rank that fails tells the others at once (they raise :class:`PeerError`) and then
    raises its own error, instead of leaving them to wait for the process group's timeout.

    Example:
        >>> with told_to_peers(None, torch.device("cpu"), "model/", "planning"):  # doctest: +SKIP
        ...     plan = read_plan(store, "model/", wants)
    """
    import torch.distributed as dist

    flag = torch.zeros(1, dtype=torch.int32, device=device)
    try:
        yield
    except BaseException:
        flag.fill_(1)
        with contextlib.suppress(Exception):  # the own error is the one to raise, whatever the peers do
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        raise
    try:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError as error:
        raise PeerError(f"lost a peer while {doing} {uri}: {str(error).splitlines()[0]}") from None
    if flag.item():
        raise PeerError(f"another rank failed while {doing} {uri}; its own error says why")


def plan_digest(plan: LoadPlan, chunks: list[Chunk]) -> int:
    """63 bits (it and its negation fit an int64) naming what a rank planned: each file's name, size and,
    for objects in a store, version (an ETag, a generation: the same object on every rank, so ranks that
    saw two revisions of the same shapes disagree), and the chunks. A local file's version (its inode and
    mtime) differs between the nodes' copies of one checkpoint, so it is left out.

    Example:
        >>> from weightstream.planning.plan import FileSpec
        >>> plan = LoadPlan("s3://b/m", (FileSpec("s3://b/m/a.safetensors", 8, 8, {}, '"etag-1"'),), ())
        >>> replaced = dataclasses.replace(plan, files=(FileSpec("s3://b/m/a.safetensors", 8, 8, {}, '"etag-2"'),))
        >>> plan_digest(plan, []) != plan_digest(replaced, [])
        True
    """
    import xxhash

    remote = plan.uri.startswith(REMOTE_SCHEMES)
    files = [(spec.path.rsplit("/", 1)[-1], spec.size, spec.version if remote else None) for spec in plan.files]
    return xxhash.xxh3_64_intdigest(repr(files + [dataclasses.astuple(chunk) for chunk in chunks]).encode()) >> 1


def _check_same_plan(plan: LoadPlan, chunks: list[Chunk], group: Any, device: torch.device) -> None:
    """Every rank must have planned the same chunks of the same files (same checkpoint, same filter)."""
    import torch.distributed as dist

    digest = plan_digest(plan, chunks)
    extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)  # the largest digest, and minus the smallest
    if int(extremes[0]) != digest or int(extremes[1]) != -digest:
        raise PeerError(
            f"{plan.uri}: the ranks planned different loads (other files, sizes, versions or filters); every rank must "
            "load the same"
        )
