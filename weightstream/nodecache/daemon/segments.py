"""The cache's segments: one file of a checkpoint in one shared-memory file, written once, then read-only.

The store is a directory (by default on ``/dev/shm``, a tmpfs: its files are shared memory) that the
daemon owns. A segment is filled under a temporary name, made read-only (mode 0444), renamed to
``<key>.seg``, and only then described by ``<key>.json``, its manifest, written last (under a temporary
name, then renamed). So a directory holds, for every key, either a complete segment with its manifest
or nothing that counts: a daemon killed mid-fill leaves a temporary file that the next one removes.
Evicting removes the manifest first, then the file; processes that mapped it keep their memory until
they unmap it (the kernel frees a deleted tmpfs file's pages when its last mapping goes).

A key names a source file at one version: ``sha256(uri, size, version)``. A changed source (another
inode or mtime, ETag, generation) is another key; an entry is never served for a version it was not
filled from.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import mmap
import os
import time
from collections.abc import Callable

from weightstream.errors import CacheError, CacheFullError, FormatError, logger
from weightstream.formats.strict_json import parse_json
from weightstream.nodecache.daemon.limits import MEMORY_RESERVE_BYTES, cgroup_room, mem_available, tmpfs_huge_pages
from weightstream.nodecache.daemon.references import KEY, references
from weightstream.nodecache.protocol import HEAD_BYTES, head_digest
from weightstream.sources.base import Source
from weightstream.sources.local import DIRECT_ALIGNMENT

log = logger(__name__)

FILL_CHUNK_BYTES = 8 << 20
"""The fill's read requests."""
MANIFEST_VERSION = 2


def segment_key(uri: str, size: int, version: str | None) -> str:
    """The key of ``uri`` at ``version`` (of ``size`` bytes).

    Example:
        >>> segment_key("/m/a.safetensors", 8, "1:2:3") == segment_key("/m/a.safetensors", 8, "1:2:4")
        False
    """
    return hashlib.sha256(json.dumps([uri, size, version]).encode()).hexdigest()[:32]


@dataclasses.dataclass
class Segment:
    """One complete segment, as its manifest describes it."""

    key: str
    uri: str
    size: int
    version: str | None
    head_sha256: str
    filled_seconds: float
    """How long its fill took (reading the source into shared memory)."""
    last_used: float = 0.0
    """When it was last attached (``time.time()``; the manifest's mtime after a restart)."""

    def describe(self) -> dict[str, object]:
        """What ``ls`` shows of it."""
        return {
            "key": self.key,
            "uri": self.uri,
            "size": self.size,
            "version": self.version,
            "last_used": self.last_used,
            "filled_seconds": round(self.filled_seconds, 3),
        }


class SegmentStore:
    """The segments in ``directory``, at most ``budget`` bytes of them (``None``: as many as memory allows).

    Not thread-safe: the daemon calls it under its lock (fills run outside it, see :meth:`fill`).
    """

    def __init__(
        self,
        directory: str,
        budget: int | None,
        huge_pages: str = "auto",
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        self.directory = directory
        self.budget = budget
        self._on_evict = on_evict
        """Told each evicted key (the daemon drops the segment's device copies)."""
        os.makedirs(directory, mode=0o700, exist_ok=True)
        status = os.stat(directory)
        if status.st_uid != os.getuid() or status.st_mode & 0o022:
            raise CacheError(
                f"{directory}: the cache directory must belong to this user (uid {os.getuid()}) and be writable by it "
                f"alone; it is uid {status.st_uid}, mode {oct(status.st_mode & 0o777)}"
            )
        self.filesystem_huge_pages = tmpfs_huge_pages(directory)
        """The ``huge=`` policy of the tmpfs holding the directory (``never``, ``always``, ``within_size``,
        ``advise``), or ``None`` where it is no tmpfs."""
        if huge_pages not in ("auto", "on", "off"):
            raise CacheError(f"huge_pages must be auto, on or off, got {huge_pages!r}")
        if huge_pages == "on" and self.filesystem_huge_pages in (None, "never", "deny"):
            raise CacheError(
                f"{directory}: huge pages asked for, but its filesystem gives none (tmpfs huge="
                f"{self.filesystem_huge_pages}); mount one for the cache: mount -t tmpfs -o size=SIZE,huge=always "
                f"tmpfs DIR"
            )
        self.advise_huge_pages = huge_pages != "off"
        """Fills ask for huge pages (``MADV_HUGEPAGE``: honoured on a tmpfs mounted ``huge=advise``)."""
        self.segments: dict[str, Segment] = {}
        self.adopted, self.discarded = self._adopt()

    @property
    def used_bytes(self) -> int:
        return sum(segment.size for segment in self.segments.values())

    def path(self, key: str) -> str:
        return os.path.join(self.directory, f"{key}.seg")

    def open_segment(self, key: str) -> int:
        """A read-only descriptor of segment ``key``'s file (the caller closes it)."""
        self.segments[key].last_used = time.time()
        return os.open(self.path(key), os.O_RDONLY | os.O_CLOEXEC)

    def make_room(self, size: int, referenced: Callable[[], set[str]], uri: str) -> None:
        """Evict unreferenced segments, least recently used first, until ``size`` more bytes fit the budget,
        the filesystem and the memory the daemon may still charge; or raise before anything is read.
        ``referenced`` (the keys in use: a scan of ``/proc``) is asked only when something must go.

        Raises:
            CacheFullError: ``size`` cannot fit even with every unreferenced segment evicted.
        """
        if self._shortfall(size) is None:
            return
        in_use = referenced()
        evictable = sorted(
            (segment for key, segment in self.segments.items() if key not in in_use), key=lambda s: s.last_used
        )
        while (shortfall := self._shortfall(size)) is not None:
            if not evictable:
                raise CacheFullError(f"{uri}: {size} bytes do not fit the cache: {shortfall}")
            victim = evictable.pop(0)
            log.info(
                "evicting %s (%s, %d bytes, unused since %.0f)", victim.key, victim.uri, victim.size, victim.last_used
            )
            self.evict(victim.key)

    def fill(self, key: str, source: Source, threads: int) -> Segment:
        """Read ``source`` whole into a new segment ``key`` and publish it (file, then manifest).

        Safe to run outside the daemon's lock: it writes only its own temporary file until it renames it.
        On any error the temporary file is removed and nothing is published.
        """
        started = time.perf_counter()
        temporary = os.path.join(self.directory, f"tmp-{key}-{os.getpid()}-{time.monotonic_ns()}")
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                if source.size:
                    # Direct reads fill whole blocks: the file is padded while it fills, then cut to its size.
                    padded = -(-source.size // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT if source.direct else source.size
                    os.ftruncate(fd, padded)
                    _read_whole(source, fd, padded, threads, self.advise_huge_pages)
                    os.ftruncate(fd, source.size)
                source.verify_unchanged()
                head = head_digest(os.pread(fd, min(source.size, HEAD_BYTES), 0)) if source.size else head_digest(b"")
                os.fchmod(fd, 0o444)
            finally:
                os.close(fd)
            os.rename(temporary, self.path(key))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
        segment = Segment(
            key, source.uri, source.size, source.version, head, time.perf_counter() - started, time.time()
        )
        self._write_manifest(segment)
        return segment

    def publish(self, segment: Segment) -> None:
        """Make a filled segment servable."""
        self.segments[segment.key] = segment

    def evict(self, key: str) -> None:
        """Remove segment ``key``: its manifest first (so it no longer counts), then its file."""
        self.segments.pop(key, None)
        for name in (f"{key}.json", f"{key}.seg"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, name))
        if self._on_evict is not None:
            self._on_evict(key)

    def references(self) -> dict[str, set[int]]:
        """Processes that map (or hold open) each segment: key -> pids, read from ``/proc``."""
        return references(self.directory)

    def _shortfall(self, size: int) -> str | None:
        """Why ``size`` more bytes do not fit now, or None if they do."""
        if self.budget is not None and self.used_bytes + size > self.budget:
            return f"the budget is {self.budget} bytes and {self.used_bytes} are held"
        free = os.statvfs(self.directory)
        if free.f_bavail * free.f_frsize < size:
            return f"{self.directory} has {free.f_bavail * free.f_frsize} bytes free"
        available = mem_available()
        if available is not None and available - MEMORY_RESERVE_BYTES < size:
            return (
                f"the machine has {available} bytes of memory available (MemAvailable), "
                f"{MEMORY_RESERVE_BYTES} kept free"
            )
        room = cgroup_room()
        if room is not None and room - MEMORY_RESERVE_BYTES < size:
            return (
                f"the daemon's memory cgroup may be charged {room} more bytes (its limit less its usage), shared "
                f"memory is charged to it, {MEMORY_RESERVE_BYTES} kept free"
            )
        return None

    def _write_manifest(self, segment: Segment) -> None:
        record = {"manifest_version": MANIFEST_VERSION, **dataclasses.asdict(segment)}
        del record["last_used"]
        temporary = os.path.join(self.directory, f"tmp-{segment.key}.json")
        with open(temporary, "w") as manifest:
            json.dump(record, manifest)
        os.rename(temporary, os.path.join(self.directory, f"{segment.key}.json"))

    def _adopt(self) -> tuple[int, int]:
        """Take the complete segments a previous daemon left and remove every other file: (adopted, discarded)."""
        names = os.listdir(self.directory)
        for name in names:
            if name.endswith(".json") and KEY.match(name[:-5]):
                segment = self._read_manifest(os.path.join(self.directory, name), name[:-5])
                if segment is not None:
                    self.segments[segment.key] = segment
        kept = {f"{key}{suffix}" for key in self.segments for suffix in (".json", ".seg")}
        discarded = 0
        for name in names:
            if name not in kept:
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    os.unlink(os.path.join(self.directory, name))
                    discarded += 1
        return len(self.segments), discarded

    def _read_manifest(self, path: str, key: str) -> Segment | None:
        try:
            with open(path) as manifest:
                record = parse_json(manifest.read(1 << 16), FormatError, path)
            segment = Segment(
                **{field.name: record[field.name] for field in dataclasses.fields(Segment) if field.name != "last_used"}
            )
            status = os.stat(self.path(key))
        except (OSError, FormatError, KeyError, TypeError) as error:
            log.warning("discarding cache entry %s: %s", key, error)
            self.evict(key)
            return None
        if (
            record.get("manifest_version") != MANIFEST_VERSION
            or segment.key != key
            or status.st_size != segment.size
            or status.st_mode & 0o222
        ):
            log.warning("discarding cache entry %s: its manifest and file disagree", key)
            self.evict(key)
            return None
        segment.last_used = os.stat(path).st_mtime
        return segment


def _read_whole(source: Source, fd: int, length: int, threads: int, huge_pages: bool) -> None:
    """Read all of ``source`` into the file ``fd`` (already ``length`` bytes: its size, or padded to whole blocks for
    direct reads) through a shared mapping."""
    with mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapping:
        if huge_pages:
            with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KiB pages
                mapping.madvise(mmap.MADV_HUGEPAGE)
        view = memoryview(mapping)
        try:
            offsets = range(0, length, FILL_CHUNK_BYTES)
            with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="weightstream-cache-fill") as pool:
                reads = [
                    pool.submit(source.read_into, offset, view[offset : offset + FILL_CHUNK_BYTES])
                    for offset in offsets
                ]
                for read in concurrent.futures.as_completed(reads):
                    if read.exception() is not None:
                        for other in reads:
                            other.cancel()
                        raise read.exception()  # type: ignore[misc]
        finally:
            view.release()
