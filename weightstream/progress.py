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


def _clock(seconds: float) -> str:
    """``seconds`` as ``M:SS`` (``H:MM:SS`` from an hour)."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


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
        self.stream.write("\r" + self.line(now))
        self.stream.flush()

    def line(self, now: float) -> str:
        """The bar as drawn at ``now``: bytes done of the total, the rate so far, the time taken and the time left at
        that rate.

        Example:
            >>> bar = ProgressBar(label="load")
            >>> bar.total, bar.done, bar._start = 4 << 30, 1 << 30, 0.0
            >>> bar.line(2.0)
            'load [#######.......................]  25.0% 1.00/4.00 GiB 0.54 GB/s 0:02 elapsed, 0:06 left'
        """
        fraction = min(self.done / self.total, 1.0) if self.total else 1.0
        filled = int(fraction * WIDTH)
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate and self.total > self.done else 0.0
        return (
            f"{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {fraction:6.1%} "
            f"{self.done / 2**30:.2f}/{self.total / 2**30:.2f} GiB {rate / 1e9:.2f} GB/s "
            f"{_clock(elapsed)} elapsed, {_clock(left)} left"
        )

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
