"""The life of a cache entry, made explicit: absent → filling → published ⇄ handed out → evicted.

- **absent**: no segment and no fill. The first client to ask claims it (:meth:`EntryTable.hand_out`): room is
  made for it, or :class:`CacheFullError` is raised before any byte is read.
- **filling**: one fill, by the client that claimed it; every other client asking for the key waits for that
  fill and gets its segment, or its error (the same error, typed as the source raised it: the file is read once,
  never again for the waiters).
- **published**: a complete segment with its manifest; servable.
- **handed out**: published and pinned while a client's answer is made and sent (its descriptor opened, a device
  copy made). A pinned entry is never evicted, so nothing can disappear between a lookup and the descriptor
  that leaves with the answer.
- **leaving**: chosen for eviction (unpinned, no process maps or holds it open, not handed out since that was
  checked); no longer handed out (a client asking for it waits, then fills it anew), still counted until it is gone.
- **evicted**: what else holds it told first (its device copies released, the fleet's offer withdrawn from etcd and
  NIXL), then removed (manifest, then file).

The table is thread-safe: every transition happens under its lock; the fill, the ``/proc`` scan for references and
the eviction's own work (etcd, CUDA and NIXL calls, unlinking) outside it, so a slow etcd never stalls an attach.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from weightstream.errors import CacheError, CacheFullError, logger
from weightstream.nodecache.daemon.segments import Segment, SegmentStore

log = logger(__name__)


class EntryTable:
    """The entries of one :class:`SegmentStore`: which are filling, which are pinned, and eviction."""

    def __init__(self, segments: SegmentStore, references: Callable[[], dict[str, set[int]]]) -> None:
        self.segments = segments
        self._references = references
        self._lock = threading.Lock()
        self._fills: dict[str, tuple[concurrent.futures.Future[Segment], int]] = {}
        """Each entry being filled: the fill's future, and the bytes it will hold."""
        self._pins: dict[str, int] = {}
        self._leaving: dict[str, threading.Event] = {}
        """Each entry chosen for eviction and not gone yet: set once it is."""
        self._handed_out: dict[str, float] = {}
        """Key -> when it was last handed out (``time.monotonic()``): a scan that started before does not know of
        the client that got it."""

    @property
    def filling(self) -> int:
        with self._lock:
            return len(self._fills)

    def fills_in_progress(self) -> list[concurrent.futures.Future[Segment]]:
        with self._lock:
            return [future for future, _ in self._fills.values()]

    @contextlib.contextmanager
    def hand_out(self, key: str, size: int, uri: str, fill: Callable[[], Segment]) -> Iterator[tuple[Segment, bool]]:
        """The published entry ``key``, pinned while the ``with`` block runs: ``(segment, filled_now)``. An absent
        entry is claimed and ``fill()`` runs (outside the lock) to make it; a filling one is waited for.

        Raises:
            CacheFullError: an absent entry of ``size`` bytes cannot fit even with every evictable entry gone.
            whatever the fill raised, in this thread and in every thread that waited for that fill.
        """
        segment, filled = self._pin(key, size, uri, fill)
        try:
            yield segment, filled
        finally:
            with self._lock:
                self._pins[key] -= 1
                if not self._pins[key]:
                    del self._pins[key]

    def evict(self, keys: list[str] | None = None) -> tuple[list[str], list[str]]:
        """Evict ``keys`` (every entry for ``None``) that are unpinned and unreferenced: ``(evicted, kept)``.

        Raises:
            CacheError: a key the table does not hold.
        """
        started = time.monotonic()
        references = self._references()
        with self._lock:
            wanted = list(self.segments.segments) if keys is None else keys
            for key in wanted:
                if key not in self.segments.segments:
                    raise CacheError(f"no cache entry {key[:40]!r}")
            evicted = [key for key in wanted if self._evictable(key, references, started)]
            for key in evicted:
                self._leave(key)
        self._remove(evicted)
        return evicted, [key for key in wanted if key not in evicted]

    def room_for(self, size: int, uri: str) -> None:
        """Raise :class:`CacheFullError` unless ``size`` bytes could be held, every evictable entry evicted (nothing
        is evicted here: ``prefetch`` asks before it fills anything)."""
        started = time.monotonic()
        references = self._references()
        with self._lock:
            kept = sum(
                segment.size
                for key, segment in self.segments.segments.items()
                if not self._evictable(key, references, started)
            )
            evictable = self.segments.used_bytes - kept
            shortfall = self.segments.shortfall(size + self._filling_bytes(), freed=evictable)
        if shortfall is not None:
            raise CacheFullError(f"{uri}: {size} bytes do not fit the cache: {shortfall}")

    def _pin(self, key: str, size: int, uri: str, fill: Callable[[], Segment]) -> tuple[Segment, bool]:
        while True:
            with self._lock:
                leaving = self._leaving.get(key)
            if leaving is not None:
                leaving.wait()  # being evicted: once gone, filled anew
                continue
            with self._lock:
                segment = self.segments.segments.get(key)
                if segment is not None:
                    self._hold(key, segment)
                    return segment, False
                waiting = self._fills.get(key, (None, 0))[0]
                claimed = waiting is None and self._fits(size)
                if claimed:
                    waiting = concurrent.futures.Future()
                    self._fills[key] = (waiting, size)
            if claimed:
                return self._run_fill(key, waiting, fill), True  # type: ignore[arg-type]
            if waiting is not None:
                waiting.result()  # the other client's fill: its segment (pinned on the next turn), or its error
                continue
            self._make_room(size, uri)

    def _filling_bytes(self) -> int:
        """Under the lock: the bytes the fills in progress will hold."""
        return sum(size for _, size in self._fills.values())

    def _fits(self, size: int) -> bool:
        return self.segments.shortfall(size + self._filling_bytes()) is None

    def _make_room(self, size: int, uri: str) -> None:
        """Evict least recently used entries until ``size`` more bytes fit (the ``/proc`` scan outside the lock)."""
        started = time.monotonic()
        references = self._references()
        victims: list[str] = []
        try:
            with self._lock:
                evictable = sorted(
                    (s for key, s in self.segments.segments.items() if self._evictable(key, references, started)),
                    key=lambda segment: segment.last_used,
                )
                others = list(self._leaving.values())
                while shortfall := self.segments.shortfall(size + self._filling_bytes(), self._leaving_bytes()):
                    if not evictable:
                        if not victims and not others:
                            raise CacheFullError(f"{uri}: {size} bytes do not fit the cache: {shortfall}")
                        break  # room is being made: the caller asks again once it is
                    victim = evictable.pop(0)
                    log.info("evicting %s (%s, %d bytes)", victim.key, victim.uri, victim.size)
                    self._leave(victim.key)
                    victims.append(victim.key)
        finally:
            self._remove(victims)
        for leaving in others:  # evictions of other threads' free memory this fill counts on
            leaving.wait()

    def _leave(self, key: str) -> None:
        """Under the lock: ``key`` (an evictable entry) is being evicted: no longer handed out."""
        self._leaving[key] = threading.Event()

    def _leaving_bytes(self) -> int:
        """Under the lock: the bytes of entries being evicted."""
        return sum(self.segments.segments[key].size for key in self._leaving if key in self.segments.segments)

    def _remove(self, keys: list[str]) -> None:
        """Evict ``keys`` (each leaving), outside the lock: each is gone when this returns, whatever failed."""
        for key in keys:
            try:
                self.segments.evict(key)
            except Exception:  # a defect of what holds it: logged, the entry is gone all the same
                log.exception("evicting %s", key)
            finally:
                with self._lock:
                    self._handed_out.pop(key, None)
                    self._leaving.pop(key).set()

    def _evictable(self, key: str, references: dict[str, set[int]], scanned_after: float) -> bool:
        return (
            key not in self._pins
            and key not in self._leaving
            and not references.get(key)
            and self._handed_out.get(key, float("-inf")) < scanned_after
        )

    def _run_fill(self, key: str, future: concurrent.futures.Future[Segment], fill: Callable[[], Segment]) -> Segment:
        """Run the fill of claimed entry ``key`` (outside the lock), publish and pin what it made; every client
        waiting on ``future`` gets the segment, or the fill's error."""
        try:
            segment = fill()
        except BaseException as error:
            with self._lock:
                del self._fills[key]
            future.set_exception(error)
            raise
        with self._lock:
            del self._fills[key]
            self.segments.publish(segment)
            self._hold(key, segment)
        future.set_result(segment)
        return segment

    def _hold(self, key: str, segment: Segment) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1
        self._handed_out[key] = time.monotonic()
        segment.last_used = time.time()
