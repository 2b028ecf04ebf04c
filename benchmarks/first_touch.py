"""What fresh memory costs on this machine, and which way of getting it is cheapest.

Each case runs in a fresh process (as a load does), interleaved over rounds, medians:
- populate: fault in N bytes of anonymous memory (MADV_POPULATE_WRITE), no I/O;
- read: os.preadv a page-cached file into fresh anonymous memory, T threads, 8 MiB requests;
with 4 KiB pages or transparent huge pages (MADV_HUGEPAGE), torch imported as in a real load.

    python benchmarks/first_touch.py FILE [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CASE = r"""
import json, mmap, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch  # a load runs with torch imported; its libraries change the process's memory map
path, kind, pages, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
size = os.path.getsize(path)
fd = os.open(path, os.O_RDONLY)
chunk = 8 << 20
start = time.perf_counter()
mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if pages == "huge":
    mapping.madvise(mmap.MADV_HUGEPAGE)
view = memoryview(mapping)
def work(offset):
    length = min(chunk, size - offset)
    if kind == "populate":
        mapping.madvise(23, offset, length)
    else:
        os.preadv(fd, [view[offset : offset + length]], offset)
with ThreadPoolExecutor(threads) as pool:
    list(pool.map(work, range(0, size, chunk)))
print(json.dumps(size / (time.perf_counter() - start) / 1e9))
"""

CASES = [(kind, pages, threads) for kind in ("populate", "read") for pages in ("4k", "huge") for threads in (1, 2, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with open(args.file, "rb") as warm:
        while warm.read(16 << 20):
            pass
    results: dict[tuple, list[float]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for case in CASES:
            output = subprocess.run(
                [sys.executable, "-c", CASE, args.file, *map(str, case)], capture_output=True, text=True, check=True
            )
            results[case].append(json.loads(output.stdout))
    print(f"{os.path.getsize(args.file) / 2**30:.2f} GiB, {args.rounds} interleaved rounds, GB/s median (min-max)")
    for (kind, pages, threads), values in results.items():
        print(
            f"{kind:8s} {pages:4s} {threads} threads  {statistics.median(values):6.2f} "
            f"({min(values):.2f}-{max(values):.2f})"
        )


if __name__ == "__main__":
    main()
