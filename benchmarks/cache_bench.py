"""The node weight cache (issue 18): a fresh process attaching a cached checkpoint, against loading it.

Each round runs every method in a fresh process (interleaved, the page cache warm for the file methods),
timing from just before the load call (each library imported before the clock) to every 4 KiB page of every
tensor touched:

- ``cache-attach``: ``load_weights(uri, cache=SOCKET)``: views of the daemon's shared-memory segments;
- ``weightstream-owned``: ``load_weights(uri)`` from the warm page cache into owned memory;
- ``safetensors.load_file``: views of a private file mapping (the page cache's pages);
- ``cache-attach-owned``: ``load_weights(uri, cache=SOCKET, zero_copy=False)``: copies out of the segments.

And the restart case: ``--s3`` also uploads the checkpoint to a local SeaweedFS and times, in fresh processes,
``load_weights(s3://..., cache=SOCKET)`` (attach; the daemon filled it once) against ``load_weights(s3://...)``
(streaming it again), from process start to every page touched.

    python benchmarks/cache_bench.py --size 4GiB --rounds 5 --json benchmarks/cache-4gib.json

Segment pages are 4 KiB on this machine's ``/dev/shm`` (tmpfs ``huge=never``); ``--dir`` on a tmpfs mounted
``huge=always`` (``mount -t tmpfs -o size=10G,huge=always tmpfs /mnt/wsc-huge``) gives 2 MiB pages.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from weightstream.bench.demo import demo_checkpoint
from weightstream.cli import parse_size

TOUCH = """
import sys, time, json
import torch
{imports}
started = time.perf_counter()
{load}
first = None
pages = 0
for name, tensor in weights.items():
    raw = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else tensor
    pages += int(raw[::4096].sum()) if raw.numel() else 0
    first = first if first is not None else time.perf_counter() - started
total = sum(t.numel() * t.element_size() for t in weights.values())
print(json.dumps({{"seconds": time.perf_counter() - started, "bytes": total}}))
"""
LOADS = {
    "cache-attach": (
        "import weightstream, weightstream.sources.cache",
        "weights = weightstream.load_weights(sys.argv[1], cache=sys.argv[2])",
    ),
    "weightstream-owned": ("import weightstream", "weights = weightstream.load_weights(sys.argv[1])"),
    "safetensors.load_file": (
        "import glob, os\nfrom safetensors.torch import load_file",
        (
            "weights = {}\nfor path in sorted(glob.glob(os.path.join(sys.argv[1], '*.safetensors'))):\n"
            "    weights.update(load_file(path))"
        ),
    ),
    "cache-attach-owned": (
        "import weightstream, weightstream.sources.cache",
        "weights = weightstream.load_weights(sys.argv[1], cache=sys.argv[2], zero_copy=False)",
    ),
}
"""Each method's imports (before the clock, as every library's are) and its load."""
FROM_START = """
import sys, time, json
import weightstream, torch
weights = weightstream.load_weights(sys.argv[1], **json.loads(sys.argv[2]))
for tensor in weights.values():
    raw = tensor.reshape(-1).view(torch.uint8)
    int(raw[::4096].sum()) if raw.numel() else 0
print(json.dumps({"bytes": sum(t.numel() * t.element_size() for t in weights.values())}))
"""


def run(code: str, *args: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])


def timed(code: str, *args: str) -> float:
    started = time.perf_counter()
    run(code, *args)
    return time.perf_counter() - started


def start_daemon(directory: str, socket_path: str) -> subprocess.Popen:
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightstream.cli",
            "cache",
            "serve",
            "--dir",
            directory,
            "--socket",
            socket_path,
            "--json",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    daemon.stdout.readline()
    return daemon


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=4 << 30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--s3", action="store_true", help="also the restart of an S3-sourced checkpoint")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--dir",
        default="/dev/shm",
        help="where the daemon's segment directory goes: /dev/shm (4 KiB pages here) or a tmpfs mounted huge=always",
    )
    args = parser.parse_args()
    checkpoint = demo_checkpoint(args.size, shards=4)
    token = os.urandom(4).hex()
    directory, socket_path = f"{args.dir}/wsc-bench-{token}", f"/tmp/wsc-bench-{token}.sock"
    scratch = tempfile.mkdtemp(prefix="wsc-s3-")
    seaweed, uri = start_s3(checkpoint, Path(scratch)) if args.s3 else (None, None)  # before the daemon: its env
    daemon = start_daemon(directory, socket_path)
    report: dict = {
        "checkpoint": checkpoint,
        "size": args.size,
        "rounds": args.rounds,
        "segments": args.dir,
        "seconds": {},
    }
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "weightstream.cli",
                "cache",
                "prefetch",
                checkpoint,
                "--socket",
                socket_path,
                "--json",
            ],
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
        imports, load = LOADS["weightstream-owned"]
        run(TOUCH.format(imports=imports, load=load), checkpoint)  # the page cache warm
        for round_number in range(args.rounds):
            for method, (imports, load) in LOADS.items():
                result = run(TOUCH.format(imports=imports, load=load), checkpoint, socket_path)
                report["seconds"].setdefault(method, []).append(result["seconds"])
                gbps = result["bytes"] / result["seconds"] / 1e9
                print(f"round {round_number + 1}/{args.rounds} {method:24s} {gbps:7.2f} GB/s", flush=True)
        if uri is not None:
            report["s3"] = s3_restart(uri, socket_path, args.rounds)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
        shutil.rmtree(directory, ignore_errors=True)
        if seaweed is not None:
            seaweed.terminate()
            seaweed.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {method: statistics.median(values) for method, values in report["seconds"].items()}
    report["median_seconds"] = summary
    report["gbps"] = {method: args.size / seconds / 1e9 for method, seconds in summary.items()}
    base = summary["cache-attach"]
    report["attach_speedup"] = {method: seconds / base for method, seconds in summary.items()}
    print(
        json.dumps(
            {"gbps": report["gbps"], "attach_speedup": report["attach_speedup"], "s3": report.get("s3")}, indent=1
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def start_s3(checkpoint: str, scratch: Path) -> tuple[subprocess.Popen, str]:
    """A local SeaweedFS holding the checkpoint; this process's environment (inherited by the daemon and the
    loads) points at it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from objectstore_bench import BUCKET, KEYS, start_seaweedfs, upload

    process, endpoint = start_seaweedfs(scratch)
    os.environ.update({**KEYS, "AWS_ENDPOINT_URL": endpoint})
    upload(endpoint, checkpoint, "cache-bench")
    return process, f"s3://{BUCKET}/cache-bench/"


def s3_restart(uri: str, socket_path: str, rounds: int) -> dict:
    """From process start to every page touched: through the cache (filled once before) against streaming."""
    run(FROM_START, uri, json.dumps({"cache": socket_path}))  # the daemon fills it once
    seconds: dict[str, list[float]] = {}
    in_process = TOUCH.format(
        imports="import weightstream, weightstream.sources.cache",
        load="weights = weightstream.load_weights(sys.argv[1], **json.loads(sys.argv[2]))",
    )
    cached, streamed = json.dumps({"cache": socket_path}), "{}"
    for _ in range(rounds):
        seconds.setdefault("s3-through-cache", []).append(timed(FROM_START, uri, cached))
        seconds.setdefault("s3-streaming", []).append(timed(FROM_START, uri, streamed))
        seconds.setdefault("s3-through-cache-imported", []).append(run(in_process, uri, cached)["seconds"])
        seconds.setdefault("s3-streaming-imported", []).append(run(in_process, uri, streamed)["seconds"])
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {
        "seconds": seconds,
        "median_seconds": medians,
        "speedup_from_process_start": medians["s3-streaming"] / medians["s3-through-cache"],
        "speedup_imports_done": medians["s3-streaming-imported"] / medians["s3-through-cache-imported"],
    }


if __name__ == "__main__":
    sys.exit(main())
