"""The running sha256 of one blob, fed by concurrent range reads in any order and checked against its digest
when its last byte is hashed (the OCI source's integrity check)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable

from weightstream.errors import IntegrityError

REORDER_BYTES = 512 << 20
"""Pieces of one blob held aside, copied, until the hash reaches them; beyond this the blob is not checked in line."""
WAIT_FOR_TURN_S = 0.5
"""How long a reader whose piece is ahead of the hash waits for its turn before copying the piece aside."""
WHOLE_CHECK_CHUNK_BYTES = 8 << 20
"""The reads a check of a whole blob makes of its parts not held (``OciSource.verify_whole``)."""


class BlobHash:
    """The sha256 of one blob, fed pieces in any order and hashed in blob order.

    A reader whose piece is next hashes it in place, outside the lock; one whose piece is ahead waits (its
    bytes stay where they landed) for the pieces before it, for at most :data:`WAIT_FOR_TURN_S`, then copies its
    piece aside and goes on (a piece before it may never come: a gap the load does not read). Pieces set aside
    are hashed when the hash reaches them.
    """

    def __init__(self, digest: str, size: int, what: str) -> None:
        self.digest, self.size, self.what = digest, size, what
        self.hashed_bytes = 0
        """Bytes hashed, and being hashed: the next piece to hash starts here."""
        self.checked = False
        self.failure: IntegrityError | None = None
        """Set when the blob was hashed whole and did not match: every later read of it raises this again."""
        self._hash = hashlib.sha256()
        self._ahead: dict[int, bytes] = {}
        self._ahead_bytes = 0
        self._abandoned = False
        self._hashing = False
        self._turn = threading.Condition()

    def feed(self, at: int, piece: memoryview) -> None:
        """Bytes ``at..at+len(piece)`` of the blob, as read.

        Raises:
            IntegrityError: they complete the blob and it does not hash to its digest, or it was found not to before.
        """
        self.raise_if_failed()
        deadline = time.monotonic() + WAIT_FOR_TURN_S
        with self._turn:
            while not self._done() and (self._hashing or at > self.hashed_bytes):
                left = deadline - time.monotonic()
                if left <= 0 and at > self.hashed_bytes:  # a piece before it is late, or never comes: keep a copy
                    self._set_aside(at, piece)
                    return
                self._turn.wait(max(left, 0.001))
            if self._done() or at + len(piece) <= self.hashed_bytes:
                return
            start, self._hashing = self.hashed_bytes, True
            self.hashed_bytes = at + len(piece)
        try:
            self._hash.update(piece[start - at :])
            with self._turn:
                pieces = self._take_aside()
            for offset, data in pieces:
                self._hash.update(memoryview(data)[offset:])
        finally:
            with self._turn:
                self._hashing = False
                self._turn.notify_all()
                if self.hashed_bytes == self.size and not self.checked:
                    self._finish()

    def raise_if_failed(self) -> None:
        """Raise the :class:`IntegrityError` of a blob found not to match its digest (no read of it may pass)."""
        if self.failure is not None:
            raise self.failure

    @property
    def abandoned(self) -> bool:
        """Whether pieces came too far ahead of the hash to keep: the blob cannot be checked in line."""
        return self._abandoned

    def gaps(self, limit: int | None) -> list[tuple[int, int]]:
        """The unread ranges between what is hashed and what is held aside, if they total at most ``limit``
        (``None``: all of them)."""
        with self._turn:
            if self._done():
                return []
            gaps, at = [], self.hashed_bytes
            for start in sorted(self._ahead):
                if start > at:
                    gaps.append((at, start - at))
                at = max(at, start + len(self._ahead[start]))
            if at < self.size:
                gaps.append((at, self.size - at))
            return gaps if limit is None or sum(nbytes for _, nbytes in gaps) <= limit else []

    def _done(self) -> bool:
        return self.checked or self._abandoned

    def _set_aside(self, at: int, piece: memoryview) -> None:
        """Keep a copy of a piece ahead of the hash (under the lock)."""
        if self._ahead_bytes + len(piece) > REORDER_BYTES:
            self._abandoned = True  # too far ahead to keep: the blob is not checked in line
            self._ahead.clear()
            self._ahead_bytes = 0
            return
        if len(self._ahead.get(at, b"")) < len(piece):
            self._ahead_bytes += len(piece) - len(self._ahead.get(at, b""))
            self._ahead[at] = bytes(piece)

    def _take_aside(self) -> list[tuple[int, bytes]]:
        """The pieces set aside that the hash has reached, in order, with where each starts being new (under the
        lock; :attr:`hashed_bytes` moves past them)."""
        taken = []
        while True:
            reached = sorted(start for start in self._ahead if start <= self.hashed_bytes)
            if not reached:
                return taken
            for start in reached:
                data = self._ahead.pop(start)
                self._ahead_bytes -= len(data)
                if start + len(data) > self.hashed_bytes:
                    taken.append((self.hashed_bytes - start, data))
                    self.hashed_bytes = start + len(data)

    def _finish(self) -> None:
        actual = "sha256:" + self._hash.hexdigest()
        self.checked = True
        if actual != self.digest:
            self.failure = IntegrityError(
                f"{self.what}: blob {self.digest} hashes to {actual} (corrupted in the registry)"
            )
            raise self.failure


def held_blob_digest(held: memoryview, offset: int, blob_size: int, fetch: Callable[[int, memoryview], None]) -> str:
    """The digest (``sha256:...``) of a blob of ``blob_size`` bytes whose bytes ``offset..offset+len(held)`` are
    ``held`` (a file of the blob as a node cache holds it) and the rest read by ``fetch(at, into)`` (from the
    registry), hashed in blob order.

    Example:
        >>> blob = b"header" + b"weights" + b"tail"
        >>> def fetch(at, into): into[:] = blob[at : at + len(into)]
        >>> held_blob_digest(memoryview(b"weights"), 6, len(blob), fetch)[7:] == hashlib.sha256(blob).hexdigest()
        True
    """
    digest = hashlib.sha256()
    start, end = offset, offset + len(held)
    for at in range(0, blob_size, WHOLE_CHECK_CHUNK_BYTES):
        stop = min(at + WHOLE_CHECK_CHUNK_BYTES, blob_size)
        for low, high, mine in ((at, min(stop, start), False), (max(at, start), min(stop, end), True),
                                (max(at, end), stop, False)):  # fmt: skip
            if low >= high:
                continue
            if mine:
                digest.update(held[low - start : high - start])
            else:
                outside = memoryview(bytearray(high - low))
                fetch(low, outside)
                digest.update(outside)
    return "sha256:" + digest.hexdigest()
