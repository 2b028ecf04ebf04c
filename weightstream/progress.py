"""A thread-safe byte progress bar for terminals (drawn only when stderr is a terminal)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

REDRAW_SECONDS = 0.1
WIDTH = 30


class ProgressBar:
    """Counts bytes from any thread and redraws at most every 0.1 s.

    Example:
        >>> bar = ProgressBar(label="load")
        >>> with bar.expecting(100):  # doctest: +SKIP
        ...     bar.advance(50)
    """

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.total, self.label = 0, label
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._drawn_at = 0.0

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = time.perf_counter()
            if now - self._drawn_at >= REDRAW_SECONDS:
                self._drawn_at = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        fraction = self.done / self.total if self.total else 1.0
        filled = int(fraction * WIDTH)
        rate = self.done / max(now - self._start, 1e-9) / 1e9
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {fraction:6.1%} {rate:6.2f} GB/s")
        self.stream.flush()

    @contextlib.contextmanager
    def expecting(self, total: int) -> Iterator[ProgressBar]:
        """Draw the bar for ``total`` bytes while the block runs, and end its line afterwards."""
        self.total = total
        try:
            yield self
        finally:
            with self._lock:
                self._draw(time.perf_counter())
                self.stream.write("\n")
                self.stream.flush()
