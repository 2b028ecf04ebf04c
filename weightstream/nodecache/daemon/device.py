"""The cache's GPU tier: ``cache serve --device cuda:N`` keeps device copies of cached files on GPU N.

A copy is made from the file's segment the first time a client on that GPU asks for it (the ``device``
request), once however many ask at once, and exported as a POSIX descriptor (``weightstream.nodecache.vmm``)
that every later client on that GPU imports and maps read-only: no copy at all. Copies are keyed by the
segment's key and the GPU's UUID, never its index, since ``CUDA_VISIBLE_DEVICES`` numbers devices
differently in each process. ``--device-budget`` bounds the bytes of copies the daemon keeps on each GPU (a copying
load would otherwise hold the weights twice there): a copy that would pass it, or that the GPU has no room for, evicts
the least recently used ones first, and one larger than the budget is refused before anything is allocated; an
evicted copy's memory stays with the clients that imported it until they unmap it. Device copies die with the
daemon (GPU memory belongs to processes, not to a filesystem): a restarted daemon makes them again from
its segments, and clients that imported one keep theirs.

In a fleet (``--fleet``), the tier tells the fleet (:attr:`DeviceTier.offers`) of each copy of a remote file it makes,
mapped read-only for peers to read, and of each it releases, before the memory goes; and the fleet makes a copy from a
peer's (:meth:`DeviceTier.make`, ``weightstream.nodecache.daemon.fleet.devices``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from weightstream.errors import CacheError, CacheFullError, DeviceUnavailableError, logger
from weightstream.nodecache import vmm
from weightstream.nodecache.shared_mapping import map_read_only
from weightstream.sources import REMOTE_SCHEMES

log = logger(__name__)


class DeviceOffers(Protocol):
    """Who is told of the copies the tier makes and releases (the fleet's ``PeerDevices``)."""

    def offer(self, key: str, uuid: str, address: int, nbytes: int) -> None:
        """Copy ``key`` on GPU ``uuid`` is mapped read-only at ``address`` (``nbytes``) for peers to read."""

    def withdraw(self, key: str, uuid: str) -> None:
        """Copy ``key`` on GPU ``uuid`` is about to be released: no peer may read it from now on."""


@dataclasses.dataclass
class DeviceEntry:
    """One cached file's copy on one GPU."""

    copy: vmm.ExportedCopy
    made_seconds: float
    last_used: float
    offered_at: int | None = None
    """Where the copy is mapped read-only for the fleet's peers (None: not offered)."""


class DeviceTier:
    """Device copies on the GPUs ``devices`` names (``cuda:N`` as the daemon numbers them), by GPU UUID.

    Raises:
        DeviceUnavailableError: no driver, cuda-python missing, or a device that does not exist.

    Example:
        >>> tier = DeviceTier(["cuda:0"])  # doctest: +SKIP
        >>> tier.uuids  # doctest: +SKIP
        ['GPU-5f1c3a9e-0b6d-2c4e-9a7f-1e2d3c4b5a69']
    """

    def __init__(self, devices: list[str], budget: int | None = None) -> None:
        self.budget = budget
        """Most bytes of copies kept on each GPU (``None``: as many as fit)."""
        self._index: dict[str, int] = {}
        for name in devices:
            try:
                device = torch.device(name)
            except RuntimeError:
                raise DeviceUnavailableError(f"--device {name[:64]!r}: name a GPU as cuda:N") from None
            if device.type != "cuda" or device.index is None:
                raise DeviceUnavailableError(f"--device {name!r}: name a GPU as cuda:N")
            try:
                uuid = vmm.gpu_uuid(device.index)
            except DeviceUnavailableError as error:
                raise DeviceUnavailableError(f"--device {name}: {error}") from None
            self._index[uuid] = device.index
        self.uuids = sorted(self._index)
        self.offers: DeviceOffers | None = None
        """Told of each copy of a remote file made and released (set where the daemon is in a fleet)."""
        self.memory = "VRAM"
        """NIXL's kind of the tier's memory."""
        self._entries: dict[tuple[str, str], DeviceEntry] = {}
        self._making: dict[tuple[str, str], threading.Event] = {}
        self._lock = threading.Lock()

    def copy_of(self, key: str, uuid: str, segment_path: str, nbytes: int, uri: str) -> tuple[int, int]:
        """A descriptor of the copy of segment ``key`` (the file at ``segment_path``, ``nbytes``) on GPU ``uuid``,
        made now if there is none, and the copy's allocation bytes. The descriptor is a duplicate: the caller
        closes it (an eviction may release the tier's own at any time).

        Raises:
            CacheError: this daemon serves no GPU ``uuid``.
            CacheFullError: the copy does not fit the GPU even with every other copy evicted.
        """

        def from_segment(index: int) -> vmm.ExportedCopy:
            with open(segment_path, "rb") as segment:
                host = map_read_only(segment.fileno(), nbytes, what=uri)
            return vmm.ExportedCopy(nbytes, index, uri, vmm.host_writer(host.data_ptr(), nbytes, uri))

        entry = self._copy(key, uuid, nbytes, uri, from_segment)
        return os.dup(entry.copy.fd), entry.copy.allocation_bytes

    def make(self, key: str, uuid: str, nbytes: int, uri: str, write: Callable[[int], None]) -> bool:
        """Make the copy of ``key`` on GPU ``uuid`` by ``write(address)`` into its new allocation (the fleet reads a
        peer's copy there); False, with nothing written, where the copy exists already. A ``write`` that raises
        leaves no copy.

        Raises:
            CacheError, CacheFullError: as :meth:`copy_of`; and what ``write`` raises.
        """
        made = []

        def by_write(index: int) -> vmm.ExportedCopy:
            made.append(True)
            return vmm.ExportedCopy(nbytes, index, uri, write)

        self._copy(key, uuid, nbytes, uri, by_write)
        return bool(made)

    def index_of(self, uuid: str) -> int:
        """The device number of GPU ``uuid`` in this process."""
        return self._index[uuid]

    def to_host(self, address: int, host_address: int, nbytes: int) -> None:
        """Copy ``nbytes`` of a copy being made (at ``address``, inside :meth:`make`'s ``write``) to host memory."""
        vmm.copy_to_host(address, host_address, nbytes)

    def drop(self, key: str) -> None:
        """Release every GPU's copy of segment ``key`` (evicted from the host tier)."""
        with self._lock:
            dropped = [(wanted, self._entries.pop(wanted)) for wanted in list(self._entries) if wanted[0] == key]
        for wanted, entry in dropped:
            self._release(wanted, entry)

    def close(self) -> None:
        """Release every copy (clients that imported one keep it)."""
        with self._lock:
            entries, self._entries = list(self._entries.items()), {}
        for wanted, entry in entries:
            self._release(wanted, entry)

    def status(self) -> dict[str, object]:
        """What ``stats`` shows of the tier: per GPU, its copies, their bytes and the budget."""
        with self._lock:
            return {
                uuid: {
                    "index": index,
                    "budget": self.budget,
                    "entries": sum(1 for _, on in self._entries if on == uuid),
                    "bytes": sum(entry.copy.allocation_bytes for (_, on), entry in self._entries.items() if on == uuid),
                }
                for uuid, index in self._index.items()
            }

    def _copy(self, key: str, uuid: str, nbytes: int, uri: str, make: Callable[[int], vmm.ExportedCopy]) -> DeviceEntry:
        """The copy of ``key`` on GPU ``uuid``: the one there, else one ``make(index)`` makes now (once, however many
        ask at once), room made for it first, offered to the fleet's peers once made."""
        if uuid not in self._index:
            raise CacheError(f"this cache daemon keeps no device copies on {uuid}; it serves {self.uuids or 'none'}")
        if nbytes == 0:
            raise CacheError(f"{uri}: an empty file has no device copy")
        wanted = (key, uuid)
        while True:
            with self._lock:
                entry = self._entries.get(wanted)
                if entry is not None:
                    entry.last_used = time.time()
                    return entry
                making = self._making.get(wanted)
                if making is None:
                    self._making[wanted] = threading.Event()
                    break
            making.wait()  # another client's copy: made once, then found above (or this one tries again)
        try:
            entry = self._make(uuid, nbytes, uri, make)
            self._offer(wanted, entry, uri)
            with self._lock:
                self._entries[wanted] = entry
            return entry
        finally:
            with self._lock:
                self._making.pop(wanted).set()

    def _make(self, uuid: str, nbytes: int, uri: str, make: Callable[[int], vmm.ExportedCopy]) -> DeviceEntry:
        started = time.perf_counter()
        index = self._index[uuid]
        self._make_room(uuid, vmm.allocation_bytes(nbytes, index), uri)
        while True:
            try:
                copy = make(index)
                break
            except CacheFullError:
                if not self._evict_one(uuid):
                    raise
        log.info("copied %s (%d bytes) to %s in %.2f s", uri, nbytes, uuid, time.perf_counter() - started)
        return DeviceEntry(copy, time.perf_counter() - started, time.time())

    def _offer(self, wanted: tuple[str, str], entry: DeviceEntry, uri: str) -> None:
        """Offer a new copy of a remote file to the fleet's peers (a failure is logged: the copy serves this node)."""
        if self.offers is None or not uri.startswith(REMOTE_SCHEMES):
            return
        try:
            entry.offered_at = entry.copy.map_read_only()
            with vmm.on_device(self._index[wanted[1]]):  # NIXL registers the mapping as the GPU's memory
                self.offers.offer(*wanted, entry.offered_at, entry.copy.nbytes)
        except Exception as error:  # noqa: BLE001 - the fleet (etcd, NIXL) failing costs peers this copy, no more
            log.warning("%s on %s: not offered to the fleet: %s", uri, wanted[1], error)
            self._withdraw(wanted, entry)

    def _release(self, wanted: tuple[str, str], entry: DeviceEntry) -> None:
        """Withdraw the copy from the fleet, then release it."""
        self._withdraw(wanted, entry)
        entry.copy.release()

    def _withdraw(self, wanted: tuple[str, str], entry: DeviceEntry) -> None:
        if entry.offered_at is None or self.offers is None:
            return
        with vmm.on_device(self._index[wanted[1]]):
            try:
                self.offers.withdraw(*wanted)
            except Exception as error:  # noqa: BLE001 - its keys go with this node's lease; the memory goes now
                log.warning("the fleet's offer of %s on %s not withdrawn: %s", *wanted, error)
            vmm.unmap_allocation(entry.offered_at, entry.copy.allocation_bytes)
        entry.offered_at = None

    def _make_room(self, uuid: str, allocation_bytes: int, uri: str) -> None:
        """Evict least recently used copies on GPU ``uuid`` until ``allocation_bytes`` more fit the budget.

        Raises:
            CacheFullError: the copy alone is larger than the budget (nothing is evicted for it).
        """
        if self.budget is None:
            return
        if allocation_bytes > self.budget:
            raise CacheFullError(
                f"{uri}: its {allocation_bytes}-byte device copy is larger than --device-budget ({self.budget} bytes)"
            )
        while self._bytes_on(uuid) + allocation_bytes > self.budget:
            if not self._evict_one(uuid):
                return  # the copies being made by others count only once made: the next one makes room then

    def _bytes_on(self, uuid: str) -> int:
        with self._lock:
            return sum(entry.copy.allocation_bytes for (_, on), entry in self._entries.items() if on == uuid)

    def _evict_one(self, uuid: str) -> bool:
        """Release the least recently used copy on GPU ``uuid``; False when it holds none."""
        with self._lock:
            on_gpu = [(entry.last_used, wanted) for wanted, entry in self._entries.items() if wanted[1] == uuid]
            if not on_gpu:
                return False
            wanted = min(on_gpu)[1]
            victim = self._entries.pop(wanted)
        log.info("evicting a %d-byte device copy from %s to make room", victim.copy.allocation_bytes, uuid)
        self._release(wanted, victim)
        return True
