"""The terminal progress bar."""

from __future__ import annotations

import io
import re
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
    assert final.startswith("load [##############################] 100.0% 0.00/0.00 GiB ")
    assert re.search(r" GB/s 0:0\d elapsed, 0:00 left\n$", final), final


def test_the_bar_says_the_time_left_at_the_rate_so_far():
    bar = ProgressBar(label="load", stream=io.StringIO())
    bar.total, bar.done = 10 << 30, 1 << 30
    assert bar.line(bar._start + 10.0).endswith("1.00/10.00 GiB 0.11 GB/s 0:10 elapsed, 1:30 left")
    assert bar.line(bar._start + 4000.0).endswith("1:06:40 elapsed, 10:00:00 left")
