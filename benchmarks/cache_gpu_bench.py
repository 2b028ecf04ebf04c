"""The node weight cache's GPU tier (issue 18 §8): a fresh process loading a cached checkpoint onto a GPU.

Each round runs every method in a fresh process (interleaved; the page cache warm), timing from just before the
load call (libraries imported and CUDA initialised before the clock) to every tensor on the device
(``torch.cuda.synchronize``):

- ``direct``: ``load_weights(uri, device="cuda")`` from the warm page cache, through the staging ring;
- ``cache-host``: through a daemon holding host segments only: copies straight from the segments, page-locked
  read-only in place (no staging slot), or through the staging ring where the driver cannot lock read-only memory
  (the report's ``routes`` says which ran);
- ``cache-device``: through a daemon started with ``--device cuda:0``: device-to-device copies from its copy;
- ``cache-device-view``: the same with ``zero_copy=True``: read-only views of the daemon's copy, no copy at all.

    python benchmarks/cache_gpu_bench.py --size 4GiB --rounds 3 --json "$OUT/cache-gpu-4gib.json"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from weightstream.arguments import parse_size
from weightstream.bench.cache_daemon import daemon_process
from weightstream.bench.demo import demo_checkpoint

LOAD = """
import sys, time, json
import torch, weightstream, weightstream.nodecache.client, weightstream.nodecache.gpu_import
from weightstream.bench.digests import byte_sums
torch.zeros(1, device="cuda")
options = json.loads(sys.argv[2])
started = time.perf_counter()
with weightstream.open(sys.argv[1], device="cuda", **options) as checkpoint:
    weights = checkpoint.load()
    routes = checkpoint.stats.copy_routes
torch.cuda.synchronize()
seconds = time.perf_counter() - started
total = sum(t.numel() * t.element_size() for t in weights.values())
print(json.dumps({"seconds": seconds, "bytes": total, "routes": routes, "digest": byte_sums(weights),
                  "devices": sorted({str(t.device) for t in weights.values()})}))
"""


def run(checkpoint: str, options: dict) -> dict:
    """One load in a fresh process; its stderr is kept when it fails."""
    result = subprocess.run(
        [sys.executable, "-c", LOAD, checkpoint, json.dumps(options)],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if result.returncode != 0:
        raise SystemExit(f"the load with {options} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def reference(checkpoint: str) -> dict[str, int]:
    """The byte sums of the checkpoint loaded to the CPU, which every GPU load must match."""
    import weightstream
    from weightstream.bench.digests import byte_sums

    return byte_sums(weightstream.load_weights(checkpoint))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=4 << 30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    checkpoint = demo_checkpoint(args.size, shards=4)
    import torch

    if not torch.cuda.is_available():
        print(f"built {checkpoint}; no CUDA device: nothing to measure", file=sys.stderr)
        return 77  # skipped (benchmarks/gpu_check.py's convention)
    token = os.urandom(4).hex()
    host = (f"/dev/shm/wsc-gpu-host-{token}", f"/tmp/wsc-gpu-host-{token}.sock")
    device = (f"/dev/shm/wsc-gpu-dev-{token}", f"/tmp/wsc-gpu-dev-{token}.sock")
    methods = {
        "direct": {},
        "cache-host": {"cache": host[1]},
        "cache-device": {"cache": device[1]},
        "cache-device-view": {"cache": device[1], "zero_copy": True},
    }
    seconds: dict[str, list[float]] = {}
    routes: dict[str, dict[str, int]] = {}
    expected = reference(checkpoint)
    with (
        daemon_process(*host, prefetch=checkpoint),
        daemon_process(*device, prefetch=checkpoint, serve_options=("--device", "cuda:0")),
    ):
        for method, options in methods.items():  # warm: the page cache, the daemon's device copies; and checked
            warm = run(checkpoint, options)
            if warm["digest"] != expected:
                wrong = sorted(name for name in expected if warm["digest"].get(name) != expected[name])
                raise SystemExit(f"{method}: the bytes loaded differ from the checkpoint's in {wrong[:5]}")
            routes[method] = warm["routes"]
            print(f"{method}: bytes checked; copies read from {warm['routes'] or 'the staging ring (direct)'}")
        for round_number in range(args.rounds):
            for method, options in methods.items():
                result = run(checkpoint, options)
                seconds.setdefault(method, []).append(result["seconds"])
                gbps = result["bytes"] / result["seconds"] / 1e9
                print(f"round {round_number + 1}/{args.rounds} {method:18s} {gbps:8.2f} GB/s", flush=True)
    medians = {method: statistics.median(values) for method, values in seconds.items()}
    report = {
        "checkpoint": checkpoint,
        "size": args.size,
        "rounds": args.rounds,
        "seconds": seconds,
        "median_seconds": medians,
        "gbps": {method: args.size / value / 1e9 for method, value in medians.items()},
        "speedup_over_direct": {method: medians["direct"] / value for method, value in medians.items()},
        "routes": routes,
    }
    print(json.dumps({key: report[key] for key in ("gbps", "speedup_over_direct", "routes")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
