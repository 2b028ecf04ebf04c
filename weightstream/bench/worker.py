"""One measurement in a fresh process: ``python -m weightstream.bench.worker DEVICE METHOD URI FILE...``.

Each method first runs once on a tiny checkpoint of its own (imports and first-call set-up outside the clock, for every
method alike). Prints one JSON object: seconds from the call to every tensor materialised (on the CPU:
every 4 KiB page of it touched; on a GPU: the device synchronised; each tensor kept, unless the
method's consumer drops them, as ``weightstream_dropping`` does), seconds to the first
tensor, and peak RSS against the baseline; on a GPU also peak device bytes in use (sampled
from the driver, so every allocator counts) and peak pinned host bytes (torch's pinned
allocator plus weightstream's registered arenas). The CUDA context is created before the
clock starts, for every method alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import torch

from weightstream.bench.methods import METHODS_BY_DEVICE
from weightstream.bench.remote_methods import REMOTE_METHODS
from weightstream.memory import pinning

PAGE = 4096
REMOTE = "remote"
"""The worker's "device" for checkpoints in object stores (tensors land on the CPU)."""


def touch(tensor: torch.Tensor) -> int:
    """Read one byte of every page of ``tensor`` (so file-backed views are really materialised)."""
    if tensor.numel() == 0:
        return 0
    flat = tensor.reshape(-1).view(torch.uint8)
    return int(flat[::PAGE].sum())


def measure(device: str, method: str, uri: str, files: list[str]) -> dict[str, object]:
    """Run ``method`` once; ``device`` is ``cpu``, ``cuda``, or ``remote`` (a checkpoint in an object store, to the
    CPU)."""
    generator = REMOTE_METHODS[method].load if device == REMOTE else METHODS_BY_DEVICE[device][method][0]
    on_gpu = device == "cuda"
    sampler = DeviceMemorySampler() if on_gpu else None
    if device != REMOTE:
        warm_up(generator)
    baseline = _rss()
    drops = getattr(generator, "drops", False)  # the method's consumer lets go of each tensor (weightstream_dropping)
    kept, count, first = [], 0, None
    start = time.perf_counter()
    for _, tensor in generator(uri, files):
        if not on_gpu:
            touch(tensor)
        if not drops:
            kept.append(tensor)
        count += 1
        if first is None:
            first = time.perf_counter() - start
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {
        "method": method,
        "device": device,
        "seconds": seconds,
        "first_tensor_seconds": first,
        "bytes": sum(file_sizes(uri, files)),
        "tensors": count,
        "baseline_rss": baseline,
        "peak_rss": _peak_rss(),
    }
    if sampler is not None:
        result["peak_device_bytes"] = sampler.stop()
        result["peak_pinned_bytes"] = (
            torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0) + pinning.registered_bytes()[1]
        )
    return result


def warm_up(generator: Callable[[str, list[str]], Iterator[tuple[str, torch.Tensor]]]) -> None:
    """Run ``generator`` once on a tiny checkpoint of its own, before the clock: imports (weightstream's lazy ones;
    a peer's own) and first-call set-up cost every method once per process, whatever the checkpoint's size, and are
    not what a GB/s figure measures (``benchmarks/fixed_costs.py`` measures them). A method that cannot read that
    checkpoint (a sharded-state one) is measured as it is."""
    from weightstream.save.write import write_safetensors

    with tempfile.TemporaryDirectory(prefix="weightstream-bench-warm-") as directory:
        path = os.path.join(directory, "model.safetensors")
        write_safetensors(path, {"warm.weight": torch.zeros(1024)}, {"format": "pt"})
        with contextlib.suppress(Exception):  # its real run says what fails, on the checkpoint measured
            for _ in generator(path, [path]):
                pass


def file_sizes(uri: str, files: list[str]) -> list[int]:
    """Each file's size: from the filesystem, or from the object store the URI names."""
    from weightstream.sources import REMOTE_SCHEMES, store_for

    if not uri.startswith(REMOTE_SCHEMES):
        return [os.path.getsize(path) for path in files]
    with contextlib.closing(store_for(uri)) as store:
        return [store.open(path).size for path in files]


class DeviceMemorySampler:
    """Peak device bytes in use above the starting point, sampled every millisecond from the driver."""

    def __init__(self) -> None:
        torch.cuda.init()
        torch.empty(1, device="cuda:0")  # the context exists before the clock starts
        self._baseline = self._used()
        self._peak = self._baseline
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _used(self) -> int:
        free, total = torch.cuda.mem_get_info(0)
        return total - free

    def _sample(self) -> None:
        while not self._stopping.wait(0.001):
            self._peak = max(self._peak, self._used())

    def stop(self) -> int:
        self._stopping.set()
        self._thread.join()
        return max(self._peak, self._used()) - self._baseline


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
    print(json.dumps(measure(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])))
