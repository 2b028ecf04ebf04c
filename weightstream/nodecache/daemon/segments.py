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
import ctypes
import dataclasses
import hashlib
import json
import mmap
import os
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Protocol

from weightstream.errors import (
    CacheConfigError,
    CacheError,
    CacheUnavailableError,
    FormatError,
    MemoryStillInUseError,
    logger,
    redact,
)
from weightstream.formats.strict_json import parse_json
from weightstream.nodecache.daemon.directory import MARKER, is_cache_file
from weightstream.nodecache.daemon.limits import MEMORY_RESERVE_BYTES, cgroup_room, mem_available, tmpfs_huge_pages
from weightstream.nodecache.daemon.references import references
from weightstream.nodecache.protocol import HEAD_BYTES, KEY, head_digest
from weightstream.sources.base import CheckedWhole, Source
from weightstream.sources.local.file import DIRECT_ALIGNMENT
from weightstream.sources.local.raw_mapping import advise, map_file, unmap

log = logger(__name__)


class Filler(Protocol):
    """Another way than the origin alone to fill a segment, which the server picks (a fleet's node: pieces from its
    peers); the segment store knows only this."""

    def fill(
        self, key: str, source: Source, fd: int, threads: int, cancel: threading.Event | None, gpu: str | None
    ) -> bool:
        """Fill the file ``fd`` with ``source``'s bytes, checked whole against what the origin says of them; False
        where it did not (the store reads the origin alone).

        Raises:
            MemoryStillInUseError: memory of ``fd``'s may still be written (the store fills a fresh file).
        """
        ...

    def evicted(self, key: str) -> None:
        """Segment ``key``, filled by :meth:`fill`, is not kept (or was evicted)."""
        ...


FILL_CHUNK_BYTES = 8 << 20
"""The fill's read requests."""
CANCEL_POLL_S = 0.1
"""How often a fill looks whether it was cancelled (the daemon stopping)."""
MANIFEST_VERSION = 2


LOCAL_FILE = "local-file"
"""What stands for the URI in a local file's key: a local entry is keyed by the file's identity (device, inode,
modification and change times) and size, never its path, so another path to the same file is the same entry and a
path that names another file is never it."""
SIGNING_PARAMETERS = frozenset(
    {
        "sig",
        "sv",
        "ss",
        "srt",
        "sp",
        "se",
        "st",
        "spr",
        "sr",
        "si",
        "sdd",
        "ses",
        "skoid",
        "sktid",
        "skt",
        "ske",
        "sks",
        "skv",
        "saoid",
        "suoid",
        "scid",
        "signature",
        "expires",
        "key-pair-id",
        "policy",
        "token",
        "access_token",
    }
)
"""Query parameters that sign a URL (Azure SAS fields, CloudFront's, tokens) rather than name what it serves;
``X-Amz-*`` and ``X-Goog-*`` too."""


def unsigned(uri: str) -> str:
    """``uri`` without the query parameters that sign it: what a re-signed URL of the same object shares (the key
    then also holds the object's size and ETag, so an entry still names one version of one object).

    Example:
        >>> unsigned("https://a.blob.core.windows.net/c/m.safetensors?sv=2022-11-02&se=2026-12-06&sig=abc&x=1")
        'https://a.blob.core.windows.net/c/m.safetensors?x=1'
    """
    parts = urllib.parse.urlsplit(uri)
    if not parts.query:
        return uri
    kept = [
        (name, value)
        for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        if name.lower() not in SIGNING_PARAMETERS and not name.lower().startswith(("x-amz-", "x-goog-"))
    ]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(kept)))


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
        self.filesystem_huge_pages = tmpfs_huge_pages(directory)
        """The ``huge=`` policy of the tmpfs holding the directory (``never``, ``always``, ``within_size``,
        ``advise``), or ``None`` where it is no tmpfs."""
        if huge_pages not in ("auto", "on", "off"):
            raise CacheConfigError(f"huge_pages must be auto, on or off, got {huge_pages!r}")
        if huge_pages == "on" and self.filesystem_huge_pages in (None, "never", "deny"):
            raise CacheConfigError(
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

    def fill(
        self,
        key: str,
        source: Source,
        threads: int,
        cancel: threading.Event | None = None,
        filler: Filler | None = None,
        gpu: str | None = None,
    ) -> Segment:
        """Read ``source`` whole into a new segment ``key`` and publish it (file, then manifest); with ``filler``,
        filled by it where it can (for a client wanting a copy on GPU ``gpu``), else from the origin.

        Safe to run outside the daemon's lock: it writes only its own temporary file until it renames it.
        On any error the temporary file is removed and nothing is published. Once ``cancel`` is set, reads not yet
        started raise :class:`CacheUnavailableError` (the daemon is stopping). Where the filler reports that the
        file's memory may still be written (:class:`MemoryStillInUseError`), a fresh file is filled from the origin.
        """
        try:
            return self._fill(key, source, threads, cancel, filler, gpu)
        except MemoryStillInUseError as error:
            log.warning("%s: %s: filled again from the origin, into a fresh file", redact(source.uri), error)
            return self._fill(key, source, threads, cancel, None, gpu)

    def _fill(
        self,
        key: str,
        source: Source,
        threads: int,
        cancel: threading.Event | None,
        filler: Filler | None,
        gpu: str | None,
    ) -> Segment:
        started = time.perf_counter()
        temporary = os.path.join(self.directory, f"tmp-{key}-{os.getpid()}-{time.monotonic_ns()}")
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        filled = False
        try:
            try:
                filled = bool(source.size) and filler is not None and filler.fill(key, source, fd, threads, cancel, gpu)
                if source.size and not filled:
                    self._read_origin(source, fd, threads, cancel)
                if not isinstance(source, CheckedWhole):
                    source.verify_unchanged()
                elif not filled:  # the filler checked the bytes it filled against the whole already
                    source.verify_whole()  # only bytes of a blob checked whole are ever published
                head = head_digest(os.pread(fd, min(source.size, HEAD_BYTES), 0)) if source.size else head_digest(b"")
                os.fchmod(fd, 0o444)
            finally:
                os.close(fd)
            os.rename(temporary, self.path(key))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            if filled and filler is not None:
                filler.evicted(key)  # what it offers of a file that is not kept goes
            raise
        segment = Segment(
            key, redact(source.uri), source.size, source.version, head, time.perf_counter() - started, time.time()
        )
        self._write_manifest(segment)
        return segment

    def _read_origin(self, source: Source, fd: int, threads: int, cancel: threading.Event | None) -> None:
        """Read all of ``source`` from its origin into the file ``fd``."""
        # Direct reads fill whole blocks: the file is padded while it fills, then cut to its size.
        padded = -(-source.size // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT if source.direct else source.size
        os.ftruncate(fd, padded)
        _read_whole(source, fd, padded, threads, self.advise_huge_pages, cancel)
        os.ftruncate(fd, source.size)

    def publish(self, segment: Segment) -> None:
        """Make a filled segment servable."""
        self.segments[segment.key] = segment

    def evict(self, key: str) -> None:
        """Remove segment ``key``: what else holds it is told first (its device copies and the fleet's offer go),
        then its manifest (so it no longer counts), then its file."""
        try:
            if self._on_evict is not None:
                self._on_evict(key)
        finally:
            self._discard(key)

    def _discard(self, key: str) -> None:
        self.segments.pop(key, None)
        for name in (f"{key}.json", f"{key}.seg"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, name))

    def references(self) -> dict[str, set[int]]:
        """Processes that map (or hold open) each segment: key -> pids, read from ``/proc``. The daemon's own uses
        (a descriptor being sent, a device copy being made, the fleet's offer) are its own bookkeeping: pins and
        offers, never references."""
        return references(self.directory, frozenset({os.getpid()}))

    def shortfall(self, size: int, freed: int = 0) -> str | None:
        """Why ``size`` more bytes do not fit now (with ``freed`` bytes of segments evicted first), or None if they
        do: the budget, the directory's filesystem, the machine's memory, the daemon's memory cgroup."""
        if self.budget is not None and self.used_bytes - freed + size > self.budget:
            return f"the budget is {self.budget} bytes and {self.used_bytes - freed} are held"
        free = os.statvfs(self.directory)
        if free.f_bavail * free.f_frsize + freed < size:
            return f"{self.directory} has {free.f_bavail * free.f_frsize} bytes free"
        available = mem_available()
        if available is not None and available + freed - MEMORY_RESERVE_BYTES < size:
            return (
                f"the machine has {available} bytes of memory available (MemAvailable), "
                f"{MEMORY_RESERVE_BYTES} kept free"
            )
        room = cgroup_room()
        if room is not None and room + freed - MEMORY_RESERVE_BYTES < size:
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
            if not is_cache_file(name):
                if name != MARKER:
                    log.warning("%s: not a file of the cache's; left alone", os.path.join(self.directory, name))
            elif name not in kept:
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
            self._discard(key)
            return None
        if (
            record.get("manifest_version") != MANIFEST_VERSION
            or segment.key != key
            or status.st_size != segment.size
            or status.st_mode & 0o222
        ):
            log.warning("discarding cache entry %s: its manifest and file disagree", key)
            self._discard(key)
            return None
        segment.last_used = os.stat(path).st_mtime
        return segment


def _read_whole(
    source: Source, fd: int, length: int, threads: int, huge_pages: bool, cancel: threading.Event | None = None
) -> None:
    """Read all of ``source`` into the file ``fd`` (already ``length`` bytes: its size, or padded to whole blocks for
    direct reads) through a shared mapping, unmapped before this returns or raises (after a cancel, the reads under
    way are not waited for: their mapping stays until the process ends, and the daemon is stopping).

    The mapping is made with ``mmap(2)`` itself, not Python's ``mmap`` module: a view of the latter that outlives
    the fill (an error's traceback keeps the frames that wrote into it) would keep the whole segment's memory.

    Raises:
        the first read's error, as the source raised it (every other read stopped first).
        CacheUnavailableError: ``cancel`` was set before the reads were done.
    """
    try:
        address = map_file(fd, length, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as error:
        raise CacheError(f"{source.uri}: cannot map {length} bytes for its fill: {error.strerror}") from None
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="weightstream-cache-fill")
    failure: BaseException | None = None
    abandoned = False
    try:
        if huge_pages:
            advise(address, length, mmap.MADV_HUGEPAGE)  # refused without transparent huge pages: 4 KiB pages
        view = memoryview((ctypes.c_ubyte * length).from_address(address)).cast("B")
        reads = [
            pool.submit(read_piece, source, offset, view[offset : offset + FILL_CHUNK_BYTES], cancel)
            for offset in range(0, length, FILL_CHUNK_BYTES)
        ]
        del view
        pending = set(reads)
        while pending and failure is None:
            done, pending = concurrent.futures.wait(pending, CANCEL_POLL_S, concurrent.futures.FIRST_EXCEPTION)
            failure = next((read.exception() for read in done if read.exception() is not None), None)
            if failure is None and pending and cancel is not None and cancel.is_set():
                failure = CacheUnavailableError(f"{source.uri}: the cache daemon is stopping; its fill was cancelled")
                abandoned = True
        for read in reads:
            read.cancel()
    finally:
        pool.shutdown(wait=not abandoned)
        if not abandoned:
            unmap(address, length)
    if failure is not None:
        raise failure


def read_piece(source: Source, offset: int, buffer: memoryview, cancel: threading.Event | None) -> None:
    """``source``'s bytes from ``offset`` into ``buffer``, unless the daemon is stopping (``cancel`` set)."""
    if cancel is not None and cancel.is_set():
        raise CacheUnavailableError(f"{source.uri}: the cache daemon is stopping; its fill was cancelled")
    source.read_into(offset, buffer)
