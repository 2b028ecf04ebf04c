"""One measurement in a fresh process: ``python -m weightstream.bench.worker METHOD URI FILE...``.

Prints one JSON object: seconds from the call to every tensor materialised and every
4 KiB page of it touched, seconds to the first tensor, and peak RSS against the baseline.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from weightstream.bench.methods import METHODS

PAGE = 4096


def touch(tensor: torch.Tensor) -> int:
    """Read one byte of every page of ``tensor`` (so file-backed views are really materialised)."""
    if tensor.numel() == 0:
        return 0
    flat = tensor.reshape(-1).view(torch.uint8)
    return int(flat[::PAGE].sum())


def measure(method: str, uri: str, files: list[str]) -> dict[str, object]:
    generator = METHODS[method][0]
    baseline = _rss()
    kept, first = [], None
    start = time.perf_counter()
    for _, tensor in generator(uri, files):
        touch(tensor)
        kept.append(tensor)
        if first is None:
            first = time.perf_counter() - start
    seconds = time.perf_counter() - start
    return {
        "method": method,
        "seconds": seconds,
        "first_tensor_seconds": first,
        "bytes": sum(os.path.getsize(path) for path in files),
        "tensors": len(kept),
        "baseline_rss": baseline,
        "peak_rss": _peak_rss(),
    }


def _peak_rss() -> int:
    """VmHWM, this address space's high-water mark. Not ru_maxrss: exec records the parent's
    (forked) address space into it, so a child of a big parent would report the parent's size."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2], sys.argv[3:])))
