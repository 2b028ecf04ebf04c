"""A/B of the load path: this tree against a git revision, in one interleaved run that others can rerun.

    python benchmarks/ab.py 5278a7f --size 4GiB --rounds 5 --json ab.json
    python benchmarks/ab.py HEAD --b-options '{"direct_io": false}'      # one tree, two settings

Each run is a fresh process that imports one side's code (``B``: this working tree, or ``--b REV``; ``A``: ``REV``,
unpacked with ``git archive``) and calls ``weightstream.load_weights`` (or ``iter_weights`` with ``--call``) on a
checkpoint, then reads one byte of every page of every tensor, so a view of a file mapping counts as loaded only
once it is. Before each run the page cache is dropped (cold) or filled (warm) and ``mincore`` checks it; a run whose
cache is not what it should be stops the benchmark. In each round the two sides alternate and the order flips every
round, so the machine's drift falls on both.

Shapes: ``llama`` (Llama-shaped in two files, from 1.3 GB with Llama 3's vocabulary: a 525 MB embedding), ``huge``
(one tensor), ``many`` (small tensors of 64 KiB, at most 20,000). Reported per shape and cache: each side's median
GB/s with its min and max, seconds to the first tensor (``iter_weights`` only), peak RSS above the start, and the
ratio of the medians B/A (above 1: B is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

from weightstream.arguments import parse_size
from weightstream.bench.demo import LlamaShape, llama_state_dict, write_sharded
from weightstream.bench.runner import prepare_cache
from weightstream.save.write import write_safetensors

SHAPES = ("llama", "huge", "many")
CACHES = ("cold", "warm")
SMALL_TENSOR_BYTES = 64 << 10
MAX_SMALL_TENSORS = 20_000
RUN_TIMEOUT_S = 900

CHILD = r"""
import json, os, sys, time
root, call, uri, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
sys.path.insert(0, root)
import torch
import weightstream
if not os.path.realpath(weightstream.__file__).startswith(os.path.realpath(root) + os.sep):
    sys.exit(f"imported weightstream from {weightstream.__file__}, not from {root}")

def rss(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field))

def touch(tensor):
    flat = tensor.reshape(-1).view(torch.uint8)
    return int(flat[::4096].sum()) if flat.numel() else 0

baseline = rss("VmRSS:")
first = None
start = time.perf_counter()
if call == "load_weights":
    tensors = weightstream.load_weights(uri, **options)
    for tensor in tensors.values():
        touch(tensor)
else:
    tensors = {}
    for name, tensor in weightstream.iter_weights(uri, **options):
        touch(tensor)
        tensors[name] = tensor
        if first is None:
            first = time.perf_counter() - start
seconds = time.perf_counter() - start
print(json.dumps({
    "seconds": seconds, "first_tensor_seconds": first, "tensors": len(tensors),
    "bytes": sum(tensor.nbytes for tensor in tensors.values()), "peak_rss_above_start": rss("VmHWM:") - baseline,
}))
"""


def checkpoint(shape: str, size: int, directory: Path) -> tuple[str, list[str]]:
    """The checkpoint of ``shape`` near ``size`` bytes under ``directory`` (built on first use): its URI and files."""
    target = directory / f"{shape}-{size}"
    if shape == "llama":
        files = sorted(str(path) for path in target.glob("*.safetensors"))
        if not files:
            base = LlamaShape(vocab=128256, layers=0).nbytes()
            per_layer = LlamaShape(vocab=128256, layers=1).nbytes() - base
            llama = (
                LlamaShape(vocab=128256, layers=round((size - base) / per_layer))
                if size >= base + per_layer
                else LlamaShape.of_size(size)  # under 1.3 GB: no room for Llama 3's vocabulary
            )
            with _staged(target) as staging:
                write_sharded(llama_state_dict(llama), staging, shards=2)
            files = sorted(str(path) for path in target.glob("*.safetensors"))
        return str(target), files
    path = target / "model.safetensors"
    if not path.exists():
        if shape == "huge":
            state = {"huge.weight": torch.empty(size // 2, dtype=torch.bfloat16).normal_(0, 0.02)}
        else:
            count = min(MAX_SMALL_TENSORS, max(1, size // SMALL_TENSOR_BYTES))
            each = size // count // 2
            state = {
                f"small.{n}.weight": torch.empty(each, dtype=torch.bfloat16).normal_(0, 0.02) for n in range(count)
            }
        with _staged(target) as staging:
            write_safetensors(str(staging / "model.safetensors"), state, {"format": "pt"})
    return str(path), [str(path)]


@contextlib.contextmanager
def _staged(target: Path) -> Iterator[Path]:
    """A directory that becomes ``target`` only when written whole."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        yield staging
        staging.rename(target)
    finally:
        if staging.exists():
            subprocess.run(["rm", "-rf", str(staging)], check=False)


def unpack(revision: str, into: Path) -> tuple[str, Path]:
    """``revision``'s tree (its full commit id) unpacked in ``into`` (made here)."""
    found = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode != 0:
        raise SystemExit(f"ab.py: {revision!r} is not a commit of {ROOT}")
    commit = found.stdout.strip()
    root = into
    root.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, "weightstream"], capture_output=True, check=True
    ).stdout
    tar_path = into.with_suffix(".tar")
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(root, filter="data")
    tar_path.unlink()
    return commit, root


def run(root: Path, call: str, uri: str, options: dict) -> dict:
    """One run in a fresh process importing weightstream from ``root``."""
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), call, uri, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd="/",
        check=False,
    )
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or ["(no error output)"]
        raise SystemExit(f"a run of {root} failed (exit {result.returncode}): {lines[-1][-500:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    gbps = [run["bytes"] / run["seconds"] / 1e9 for run in runs]
    firsts = [run["first_tensor_seconds"] for run in runs if run["first_tensor_seconds"] is not None]
    return {
        "gbps_median": statistics.median(gbps),
        "gbps_min": min(gbps),
        "gbps_max": max(gbps),
        "first_tensor_seconds_median": statistics.median(firsts) if firsts else None,
        "peak_rss_above_start_median": statistics.median(run["peak_rss_above_start"] for run in runs),
        "runs": len(runs),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="side A: a git revision")
    parser.add_argument("--b", default=None, help="side B: another revision (default: this working tree)")
    parser.add_argument("--size", type=parse_size, default=2 << 30, help="each checkpoint's size (default 2GiB)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--caches", default=",".join(CACHES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--call", choices=("load_weights", "iter_weights"), default="load_weights")
    parser.add_argument("--a-options", type=json.loads, default={}, help="keyword arguments of side A's call (JSON)")
    parser.add_argument("--b-options", type=json.loads, default={}, help="keyword arguments of side B's call (JSON)")
    parser.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "weightstream" / "ab")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    shapes, caches = args.shapes.split(","), args.caches.split(",")
    unknown = [shape for shape in shapes if shape not in SHAPES] + [cache for cache in caches if cache not in CACHES]
    if unknown or args.rounds < 1:
        parser.error(f"unknown shapes or caches {unknown}, or rounds below 1")
    with tempfile.TemporaryDirectory(prefix="ws-ab-") as scratch:
        a_commit, a_root = unpack(args.rev, Path(scratch) / "A")
        if args.b is None:
            b_name, b_root = "working tree", ROOT
        else:
            b_name, b_root = unpack(args.b, Path(scratch) / "B")
        sides = {"A": (a_root, args.a_options), "B": (b_root, args.b_options)}
        checkpoints = {shape: checkpoint(shape, args.size, args.dir) for shape in shapes}
        runs: dict[tuple[str, str, str], list[dict]] = {}
        for number in range(args.rounds):
            order = ("A", "B") if number % 2 == 0 else ("B", "A")
            for shape in shapes:
                uri, files = checkpoints[shape]
                for cache in caches:
                    for side in order:
                        root, options = sides[side]
                        prepare_cache(files, cache)
                        result = run(root, args.call, uri, options)
                        runs.setdefault((shape, cache, side), []).append(result)
                        print(
                            f"round {number + 1}/{args.rounds} {shape:5s} {cache:4s} {side} "
                            f"{result['bytes'] / result['seconds'] / 1e9:6.2f} GB/s",
                            file=sys.stderr,
                        )
    results = []
    for shape in shapes:
        for cache in caches:
            a, b = summary(runs[(shape, cache, "A")]), summary(runs[(shape, cache, "B")])
            results.append(
                {"shape": shape, "cache": cache, "A": a, "B": b, "b_over_a": b["gbps_median"] / a["gbps_median"]}
            )
    report = {
        "A": {"revision": args.rev, "commit": a_commit, "options": args.a_options},
        "B": {"revision": b_name, "options": args.b_options},
        "call": args.call,
        "size": args.size,
        "rounds": args.rounds,
        "files": {shape: checkpoints[shape][1] for shape in shapes},
        "results": results,
    }
    for row in results:
        print(
            f"{row['shape']:5s} {row['cache']:4s}  A {_figure(row['A'])}  B {_figure(row['B'])}  "
            f"B/A {row['b_over_a']:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def _figure(side: dict) -> str:
    first = side["first_tensor_seconds_median"]
    return (
        f"{side['gbps_median']:5.2f} GB/s ({side['gbps_min']:.2f}-{side['gbps_max']:.2f})"
        + (f" first {first:.2f} s" if first is not None else "")
        + f" rss +{side['peak_rss_above_start_median'] / 2**20:,.0f} MiB"
    )


if __name__ == "__main__":
    sys.exit(main())
