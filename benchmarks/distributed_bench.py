"""The distributed benchmark: N ranks on this machine, cold page cache, against one process alone
and against the naive way (every rank reads everything), in the same interleaved rounds.

    python benchmarks/distributed_bench.py --size 4GiB --ranks 2 --rounds 3 --json out.json

Each rank is a fresh process (gloo over a loopback file rendezvous); the clock starts after a
barrier and stops when the rank has every tensor with every 4 KiB page touched; a method's wall
time is its slowest rank's. Bytes from storage are each process's ``read_bytes`` in
``/proc/self/io`` (what the block layer fetched: direct and buffered reads alike).

``memory-floor``: each of the N ranks only faults in a private buffer of the checkpoint's size (no
reads, no sharing), the least work of any way that leaves every rank its own copy. Extra loader
options for the distributed method: ``DISTRIBUTED_OPTIONS='{"chunk_bytes": 8388608}'``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from weightstream.arguments import parse_size
from weightstream.bench.demo import demo_checkpoint
from weightstream.bench.runner import prepare_cache
from weightstream.planning.discover import find_files
from weightstream.sources.local.file import LocalStore

RANK = r"""
import json, sys, time, torch
import torch.distributed as dist
import weightstream
from weightstream.bench.worker import touch
mode, init, rank, world, uri = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if world > 1:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    dist.barrier()
def storage_bytes():
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("read_bytes:"))
before = storage_bytes()
stats = weightstream.DistributedStats()
start = time.perf_counter()
if mode == "floor":
    from weightstream.memory.host import HostArena
    arena = HostArena(int(sys.argv[7]), huge_pages=False)
    arena.populate(0, arena.nbytes)
    print(json.dumps({"rank": rank, "seconds": time.perf_counter() - start, "storage_bytes": 0, "stats": vars(stats)}))
    sys.exit(0)
options = {"format": "distributed", "stats": stats, **json.loads(sys.argv[6])} if mode == "distributed" else {}
kept = []
for _, tensor in weightstream.iter_weights(uri, **options):
    touch(tensor)
    kept.append(tensor)
seconds = time.perf_counter() - start
print(json.dumps({"rank": rank, "seconds": seconds, "storage_bytes": storage_bytes() - before, "stats": vars(stats)}))
if world > 1:
    dist.destroy_process_group()
"""

METHODS = ("single", "distributed", "naive", "memory-floor")
OPTIONS = os.environ.get("DISTRIBUTED_OPTIONS", "{}")


def run(method: str, ranks: int, uri: str, total: int) -> dict:
    world = 1 if method == "single" else ranks
    mode = {"distributed": "distributed", "memory-floor": "floor"}.get(method, "plain")
    with tempfile.TemporaryDirectory() as rendezvous:
        init = f"file://{rendezvous}/rendezvous"
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, mode, init, str(rank), str(world), uri, OPTIONS, str(total)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(world)
        ]
        results = []
        for process in processes:
            output, errors = process.communicate(timeout=900)
            if process.returncode != 0:
                raise RuntimeError(f"{method}: a rank failed: {errors[-2000:]}")
            results.append(json.loads(output.strip().splitlines()[-1]))
    return {
        "seconds": max(r["seconds"] for r in results),
        "storage_bytes": sum(r["storage_bytes"] for r in results),
        "ranks": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=4 << 30)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    uri = demo_checkpoint(args.size, shards=4)
    files = list(find_files(LocalStore(), uri).files)
    total = sum(os.path.getsize(path) for path in files)
    runs: dict[str, list[dict]] = {method: [] for method in METHODS}
    for round_number in range(args.rounds):
        for method in (
            METHODS[round_number % len(METHODS) :] + METHODS[: round_number % len(METHODS)]
        ):  # each method follows each other one in turn
            prepare_cache(files, "cold")
            runs[method].append(run(method, args.ranks, uri, total))
            last = runs[method][-1]
            print(
                f"round {round_number + 1} {method:12s} {last['seconds']:6.2f} s  storage "
                f"{last['storage_bytes'] / total:.2f}x",
                file=sys.stderr,
            )
    summary = [
        {
            "method": method,
            "ranks": 1 if method == "single" else args.ranks,
            "seconds_median": statistics.median(r["seconds"] for r in measured),
            "seconds_min": min(r["seconds"] for r in measured),
            "seconds_max": max(r["seconds"] for r in measured),
            "storage_x_median": statistics.median(r["storage_bytes"] / total for r in measured),
        }
        for method, measured in runs.items()
    ]
    for row in summary:
        print(
            f"{row['method']:12s} x{row['ranks']}  {row['seconds_median']:6.2f} s "
            f"({row['seconds_min']:.2f}-{row['seconds_max']:.2f})  "
            f"storage {row['storage_x_median']:.2f}x the checkpoint"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "uri": uri,
                    "bytes": total,
                    "ranks": args.ranks,
                    "rounds": args.rounds,
                    "summary": summary,
                    "runs": runs,
                },
                out,
                indent=2,
            )


if __name__ == "__main__":
    main()
