"""Device copies between the fleet's nodes: where daemons keep copies on their GPUs (``cache serve --device``), a
node asked for a device copy of an entry it does not hold reads a peer's device copy GPU to GPU, through NIXL's
VRAM registration (UCX picks the path: GPUDirect RDMA or NVLink where the nodes have them, CUDA IPC on one host,
else staged through host memory over TCP).

Each piece lands in the new device copy, is copied to the node's host segment (device to host, over the node's own
PCIe) and checked there against the sha256 its claimer published, as a piece read from a peer's host memory is: the
device copy is kept only if every piece matched, and the host segment is then whole and offered like any other.
Where no peer offers a device copy, the entry has no published digests (a copy adopted before the fleet had it),
or the peer fails or serves bytes that do not match, the fill goes the host way (pieces from peers' segments, else
the origin), logged and counted.

Keys (under the fleet's prefix): ``devices/{entry}/{node}/{gpu}``: where ``node``'s copy of ``entry`` on GPU
``gpu`` is, for peers to read (under the node's lease).

Example:
    >>> devices = PeerDevices(fleet_fill, device_tier)  # doctest: +SKIP
    >>> stats = devices.fill(entry, "GPU-5f1c...", fd, size, uri, fill_from_hosts)  # doctest: +SKIP
    >>> stats.bytes_from_peer_devices == size  # doctest: +SKIP
    True
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import threading
import zlib
from collections.abc import Callable
from typing import Protocol

from weightstream.errors import (
    CacheFullError,
    DeviceMemoryError,
    DeviceUnavailableError,
    FleetPeerError,
    FleetUnavailableError,
    logger,
)
from weightstream.nodecache.daemon.fleet.fill import FleetFill
from weightstream.nodecache.daemon.fleet.pieces import FillStats, piece_spans
from weightstream.nodecache.daemon.fleet.records import Offer
from weightstream.nodecache.daemon.fleet.transfer import memory_at
from weightstream.sources.local.raw_mapping import map_file, unmap

log = logger(__name__)


class DeviceCopies(Protocol):
    """The daemon's device tier as the fleet uses it (``weightstream.nodecache.daemon.device.DeviceTier``)."""

    memory: str
    """NIXL's kind of the copies' memory: ``"VRAM"``."""

    def index_of(self, uuid: str) -> int:
        """The device number of GPU ``uuid``."""

    def make(self, key: str, uuid: str, nbytes: int, uri: str, write: Callable[[int], None]) -> bool:
        """Make the copy of ``key`` on ``uuid`` by ``write(address)``; False, nothing written, where it exists."""

    def to_host(self, address: int, host_address: int, nbytes: int) -> None:
        """Copy ``nbytes`` of a copy being made to host memory."""

    def drop(self, key: str) -> None:
        """Release every copy of ``key``."""


class PeerDevices:
    """This node's device copies offered to the fleet (``copies``, told by the tier as it makes and releases them),
    and device fills from peers' copies, through ``fleet``'s etcd and NIXL agents."""

    def __init__(self, fleet: FleetFill, copies: DeviceCopies) -> None:
        self.fleet, self.copies = fleet, copies
        self._offered: dict[tuple[str, str], Offer] = {}
        """Each (entry, GPU) offered, and where peers read it (put again under a new lease)."""
        self._lock = threading.Lock()
        fleet.membership.on_registered_again.append(self._offer_again)

    def offer(self, key: str, uuid: str, address: int, nbytes: int) -> None:
        """Offer this node's copy of entry ``key`` on GPU ``uuid``, mapped read-only at ``address``, to peers."""
        where = self.fleet.server.publish_memory(
            f"{key}/{uuid}", address, nbytes, self.copies.memory, self.copies.index_of(uuid)
        )
        offered = dataclasses.replace(where, gpu=uuid)
        with self._lock:
            self._offered[key, uuid] = offered
        self.fleet.etcd.put(self._key(key, uuid), offered.encode(), self.fleet.membership.lease)

    def withdraw(self, key: str, uuid: str) -> None:
        """Stop offering this node's copy of ``key`` on ``uuid`` (peers reading it from now on fail, and go the host
        way)."""
        with self._lock:
            self._offered.pop((key, uuid), None)
        self.fleet.server.withdraw(f"{key}/{uuid}")
        try:
            self.fleet.etcd.delete(self._key(key, uuid))
        except FleetUnavailableError as error:
            log.warning("fleet: the copy of %s on %s withdrawn, etcd not told (%s): it goes with the lease", key,
                        uuid, error)  # fmt: skip

    def fill(
        self, entry: str, uuid: str, fd: int, size: int, uri: str, from_hosts: Callable[[], FillStats]
    ) -> FillStats:
        """Fill this node's copy of ``entry`` on GPU ``uuid`` and its host segment (the file ``fd``, ``size`` bytes)
        from a peer's device copy; where none can serve it, ``from_hosts()`` fills the segment (the tier then copies
        it to the GPU as for any client). Where the bytes came from.

        Raises:
            SourceChangedError, SourceError, FleetUnavailableError: as ``from_hosts`` raises them.
        """
        holders = self._holders(entry, size)
        digests = self._digests(entry, size) if holders else None
        if not holders or digests is None:
            return from_hosts()
        failures = 0
        address = map_file(fd, size, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            for peer, where in holders:
                stats = FillStats()
                try:
                    read = self._reader(peer, where, entry, self.copies.index_of(uuid), address, digests, stats)
                    if not self.copies.make(entry, uuid, size, uri, read):
                        break  # a copy there already (made from a segment meanwhile): the segment comes the host way
                except FleetPeerError as error:
                    self.fleet.fetcher.forget(peer)
                    log.warning("%s: %s; trying another peer's copy, else the host way", uri, error)
                    failures += 1
                    continue
                except (CacheFullError, DeviceUnavailableError, DeviceMemoryError) as error:
                    log.warning("%s: no device copy made from a peer's (%s): filling the host way", uri, error)
                    break
                stats.peer_failures = failures
                try:
                    self.fleet.offer(entry, fd, size)
                except FleetUnavailableError as error:
                    log.warning("fleet: %s filled from a peer's device copy, not offered (%s)", uri, error)
                return stats
        finally:
            unmap(address, size)
        stats = from_hosts()
        stats.peer_failures += failures
        return stats

    def _reader(
        self,
        peer: str,
        where: Offer,
        entry: str,
        device: int,
        host: int,
        digests: list[tuple[int, int, str]],
        stats: FillStats,
    ) -> Callable[[int], None]:
        """The ``write`` that reads ``peer``'s copy of ``entry`` piece by piece into a new copy at ``address`` on
        ``device``, each piece copied to host memory at ``host`` and checked against its digest there."""

        def read(address: int) -> None:
            for offset, nbytes, sha256 in digests:
                self.fleet.fetcher.read(
                    peer,
                    where,
                    offset,
                    nbytes,
                    address + offset,
                    memory=self.copies.memory,
                    device=device,
                    served_as=entry,
                )
                self.copies.to_host(address + offset, host + offset, nbytes)
                got = hashlib.sha256(memory_at(host + offset, nbytes)).hexdigest()
                if got != sha256:
                    raise FleetPeerError(
                        f"{peer}: its device copy's bytes {offset}..{offset + nbytes} hash to {got[:16]}..., not "
                        f"the claimer's {sha256[:16]}...: discarded"
                    )
                stats.bytes_from_peers += nbytes
                stats.bytes_from_peer_devices += nbytes
                stats.pieces_verified += 1

        return read

    def _holders(self, entry: str, size: int) -> list[tuple[str, Offer]]:
        """Other nodes' device copies of ``entry`` (peer, where), in an order of this node's
        own (nodes filling at once spread over the holders); none where etcd does not answer."""
        try:
            offers = self.fleet.store.device_offers(entry)
        except FleetUnavailableError as error:
            log.warning("fleet: %s: device copies not looked up (%s)", entry, error)
            return []
        holders = [
            (peer, where)
            for peer, where, _ in offers
            if peer != self.fleet.node and where.size == size and where.gpu is not None
        ]
        turn = zlib.crc32(self.fleet.node.encode()) % len(holders) if holders else 0
        return holders[turn:] + holders[:turn]

    def _digests(self, entry: str, size: int) -> list[tuple[int, int, str]] | None:
        """Each piece of ``entry`` (offset, bytes, sha256) by the fleet's plan; None where a digest is missing (the
        pieces cannot be checked)."""
        try:
            piece_bytes = self.fleet.store.plan(entry)
            digests = self.fleet.store.digests(entry) if piece_bytes else {}
        except FleetUnavailableError as error:
            log.warning("fleet: %s: digests not read (%s)", entry, error)
            return None
        spans = piece_spans(size, piece_bytes) if piece_bytes else []
        if not spans or any(piece not in digests for piece in range(len(spans))):
            log.info("fleet: %s has no digest for every piece: not read from a peer's device copy", entry)
            return None
        return [(offset, nbytes, digests[piece]) for piece, (offset, nbytes) in enumerate(spans)]

    def _offer_again(self, lease: int) -> None:
        with self._lock:
            offered = dict(self._offered)
        for (key, uuid), where in offered.items():
            self.fleet.etcd.put(self._key(key, uuid), where.encode(), lease)

    def _key(self, key: str, uuid: str) -> str:
        return self.fleet.keys.device(key, self.fleet.node, uuid)
