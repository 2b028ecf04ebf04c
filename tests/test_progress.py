"""The terminal progress bar."""

from __future__ import annotations

import io
import threading

from weightstream.progress import ProgressBar


def test_bar_counts_bytes_from_many_threads_and_ends_its_line():
    stream = io.StringIO()
    bar = ProgressBar(label="load", stream=stream)
    with bar.expecting(8000):
        threads = [threading.Thread(target=lambda: [bar.advance(10) for _ in range(100)]) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert bar.done == 8000
    final = stream.getvalue().split("\r")[-1]
    assert final.startswith("load [##############################] 100.0%")
    assert final.endswith("GB/s\n")
