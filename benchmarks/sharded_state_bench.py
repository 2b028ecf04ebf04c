"""The sharded-state benchmark: rank 0 of a tensor-parallel state against the core loader reading
the whole checkpoint, in the same interleaved rounds.

    python benchmarks/sharded_state_bench.py --size 4GiB --tp 2 --rounds 3 --json out.json

Builds (or reuses) the demo checkpoint, converts it with ``weightstream convert`` (cached beside
it), then measures, each run a fresh process with the page cache cold (dropped and checked) or
warm: ``weightstream`` on the whole Hugging Face checkpoint, ``weightstream-rank0`` (rank 0's
files) and ``weightstream-rank0-verify`` (the same, every byte checked against the manifest).
GB/s are per method's own bytes: the whole checkpoint, or rank 0's files.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from weightstream.arguments import parse_size
from weightstream.bench.demo import demo_checkpoint
from weightstream.bench.runner import prepare_cache, run_worker
from weightstream.planning.discover import find_files
from weightstream.save.convert import convert_to_sharded_state
from weightstream.sources.local.file import LocalStore

METHODS = ("weightstream", "weightstream-rank0", "weightstream-rank0-verify")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=4 << 30)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of: " + ", ".join(METHODS))
    parser.add_argument("--cache", default="cold,warm", help="page-cache states: cold,warm")
    parser.add_argument("--json", default=None, help="write the runs and medians here")
    args = parser.parse_args()
    source = demo_checkpoint(args.size, shards=4)
    sharded = f"{source}-tp{args.tp}"
    if not os.path.exists(os.path.join(sharded, "weightstream-manifest-rank-0.json")):
        print(f"converting {source} into {sharded} ...", file=sys.stderr)
        convert_to_sharded_state(source, sharded, tp=args.tp)
    whole = list(find_files(LocalStore(), source).files)
    rank_zero = sorted(
        os.path.join(sharded, name) for name in os.listdir(sharded) if name.startswith("model-rank-0-part-")
    )
    every_file = whole + [os.path.join(sharded, name) for name in os.listdir(sharded) if name.endswith(".safetensors")]
    targets = {
        "weightstream": (source, whole),
        "weightstream-rank0": (sharded, rank_zero),
        "weightstream-rank0-verify": (sharded, rank_zero),
    }
    methods, caches = args.methods.split(","), args.cache.split(",")
    runs: dict[tuple[str, str], list[dict]] = {(method, cache): [] for method in methods for cache in caches}
    for round_number in range(args.rounds):
        for cache in caches:
            for method in methods:
                uri, files = targets[method]
                prepare_cache(every_file if cache == "cold" else files, cache)
                run = run_worker("cpu", method, uri, files)
                runs[method, cache].append(run)
                print(
                    f"round {round_number + 1} {cache} {method:26s} {run['bytes'] / run['seconds'] / 1e9:5.2f} GB/s "
                    f"{run['seconds']:6.2f} s",
                    file=sys.stderr,
                )
    summary = []
    for (method, cache), measured in runs.items():
        gbps = [run["bytes"] / run["seconds"] / 1e9 for run in measured]
        summary.append(
            {
                "method": method,
                "cache": cache,
                "gbps_median": statistics.median(gbps),
                "gbps_min": min(gbps),
                "gbps_max": max(gbps),
                "seconds_median": statistics.median(run["seconds"] for run in measured),
                "bytes": measured[0]["bytes"],
                "peak_rss_above_baseline_median": statistics.median(
                    run["peak_rss"] - run["baseline_rss"] for run in measured
                ),
            }
        )
    for row in summary:
        print(
            f"{row['cache']:4s} {row['method']:26s} {row['gbps_median']:5.2f} GB/s "
            f"({row['gbps_min']:.2f}-{row['gbps_max']:.2f}) "
            f"{row['seconds_median']:6.2f} s  {row['bytes'] / 2**30:.2f} GiB"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "source": source,
                    "sharded": sharded,
                    "tp": args.tp,
                    "rounds": args.rounds,
                    "summary": summary,
                    "runs": {f"{m}/{c}": r for (m, c), r in runs.items()},
                },
                out,
                indent=2,
            )


if __name__ == "__main__":
    main()
