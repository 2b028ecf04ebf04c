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
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import torch

from weightstream.errors import CacheError, CacheFullError, DeviceUnavailableError, logger
from weightstream.nodecache import vmm
from weightstream.nodecache.shared_mapping import map_read_only

log = logger(__name__)


@dataclasses.dataclass
class DeviceEntry:
    """One cached file's copy on one GPU."""

    copy: vmm.ExportedCopy
    made_seconds: float
    last_used: float


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
                    return os.dup(entry.copy.fd), entry.copy.allocation_bytes
                making = self._making.get(wanted)
                if making is None:
                    self._making[wanted] = threading.Event()
                    break
            making.wait()  # another client's copy: made once, then found above (or this one tries again)
        try:
            entry = self._make(uuid, segment_path, nbytes, uri)
            with self._lock:
                self._entries[wanted] = entry
                return os.dup(entry.copy.fd), entry.copy.allocation_bytes
        finally:
            with self._lock:
                self._making.pop(wanted).set()

    def drop(self, key: str) -> None:
        """Release every GPU's copy of segment ``key`` (evicted from the host tier)."""
        with self._lock:
            dropped = [self._entries.pop(wanted) for wanted in list(self._entries) if wanted[0] == key]
        for entry in dropped:
            entry.copy.release()

    def close(self) -> None:
        """Release every copy (clients that imported one keep it)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            entry.copy.release()

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

    def _make(self, uuid: str, segment_path: str, nbytes: int, uri: str) -> DeviceEntry:
        started = time.perf_counter()
        index = self._index[uuid]
        self._make_room(uuid, vmm.allocation_bytes(nbytes, index), uri)
        with open(segment_path, "rb") as segment:
            host = map_read_only(segment.fileno(), nbytes, what=uri)
        while True:
            try:
                copy = vmm.ExportedCopy(host.data_ptr(), nbytes, index, uri)
                break
            except CacheFullError:
                if not self._evict_one(uuid):
                    raise
        log.info("copied %s (%d bytes) to %s in %.2f s", uri, nbytes, uuid, time.perf_counter() - started)
        return DeviceEntry(copy, time.perf_counter() - started, time.time())

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
            victim = self._entries.pop(min(on_gpu)[1])
        log.info("evicting a %d-byte device copy from %s to make room", victim.copy.allocation_bytes, uuid)
        victim.copy.release()
        return True
