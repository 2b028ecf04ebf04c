"""The node weight cache (issue 18): a fresh process attaching a cached checkpoint, against loading it.

Each round runs every method in a fresh process (interleaved, the page cache warm for the file methods),
timing from just before the load call (each library imported before the clock) to every 4 KiB page of every
tensor touched:

- ``cache-attach``: ``load_weights(uri, cache=SOCKET)``: views of the daemon's shared-memory segments;
- ``weightstream-owned``: ``load_weights(uri)`` from the warm page cache into owned memory;
- ``safetensors.load_file``: views of a private file mapping (the page cache's pages);
- ``cache-attach-owned``: ``load_weights(uri, cache=SOCKET, zero_copy=False)``: copies out of the segments.

``--processes N``: N processes at once, page cache cold and the cache empty, each holding every tensor of the
checkpoint: bytes read from storage (theirs, and the daemon's) and node memory (Shmem + their anonymous RSS, and
the same less an idle interpreter's anonymous RSS each), against N direct loads.

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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from weightstream.arguments import parse_size
from weightstream.bench.cache_daemon import daemon_process
from weightstream.bench.demo import demo_checkpoint

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
        "import weightstream, weightstream.nodecache.client",
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
        "import weightstream, weightstream.nodecache.client",
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


HOLDER = """
import sys, json
import torch, weightstream
weights = weightstream.load_weights(sys.argv[1], **json.loads(sys.argv[2])) if sys.argv[1] else {}
for tensor in weights.values():
    raw = tensor.reshape(-1).view(torch.uint8)
    int(raw[::4096].sum()) if raw.numel() else 0
status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith("Rss"))
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
rss_anon = int(status["RssAnon"].split()[0]) * 1024
print(json.dumps({"rss_anon": rss_anon, "read_bytes": int(io["read_bytes"])}), flush=True)
sys.stdin.readline()  # hold the weights until the parent has measured the node
"""


def shmem_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("Shmem:"))


def read_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("read_bytes:"))


def processes(checkpoint: str, count: int, options: dict, daemon_pid: int | None) -> dict:
    """``count`` processes loading ``checkpoint`` at once from a cold page cache (and an empty cache):
    bytes read from storage (theirs and the daemon's) and node memory (Shmem + their anonymous RSS)."""
    from weightstream.sources.local.pagecache import drop

    for path in Path(checkpoint).glob("*.safetensors"):
        drop(str(path))
    shmem_before = shmem_bytes()
    daemon_before = read_bytes(daemon_pid) if daemon_pid is not None else 0
    started = time.perf_counter()
    children = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, checkpoint, json.dumps(options)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    reports = [json.loads(child.stdout.readline()) for child in children]
    seconds = time.perf_counter() - started
    shmem = shmem_bytes() - shmem_before
    for child in children:
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(timeout=60)
        child.stdout.close()
    baseline = json.loads(
        subprocess.run(
            [sys.executable, "-c", HOLDER, "", "{}"], input="\n", cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    )["rss_anon"]
    storage = sum(report["read_bytes"] for report in reports)
    storage += read_bytes(daemon_pid) - daemon_before if daemon_pid is not None else 0
    return {
        "seconds": seconds,
        "storage_read_bytes": storage,
        "node_memory_bytes": shmem + sum(report["rss_anon"] for report in reports),
        "shmem_bytes": shmem,
        "rss_anon_bytes": [report["rss_anon"] for report in reports],
        "interpreter_rss_anon_bytes": baseline,
        "node_memory_for_weights_bytes": shmem + sum(report["rss_anon"] - baseline for report in reports),
    }


def run(code: str, *args: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])


def timed(code: str, *args: str) -> float:
    started = time.perf_counter()
    run(code, *args)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=4 << 30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--s3", action="store_true", help="also the restart of an S3-sourced checkpoint")
    parser.add_argument(
        "--processes", type=int, default=0, help="also N processes loading at once, cold: storage bytes, node memory"
    )
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
    try:
        seaweed, uri = start_s3(checkpoint, Path(scratch)) if args.s3 else (None, None)  # before the daemon: its env
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    report: dict = {
        "checkpoint": checkpoint,
        "size": args.size,
        "rounds": args.rounds,
        "segments": args.dir,
        "seconds": {},
    }
    try:
        with daemon_process(directory, socket_path, prefetch=checkpoint) as daemon:
            measure(args, checkpoint, socket_path, daemon.pid, uri, report)
    finally:
        if seaweed is not None:
            seaweed.terminate()
            seaweed.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {method: statistics.median(values) for method, values in report["seconds"].items()}
    report["median_seconds"] = summary
    report["gbps"] = {method: args.size / seconds / 1e9 for method, seconds in summary.items()}
    base = summary["cache-attach"]
    report["attach_speedup"] = {method: seconds / base for method, seconds in summary.items()}
    print(json.dumps({key: report.get(key) for key in ("gbps", "attach_speedup", "s3", "processes")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def measure(
    args: argparse.Namespace, checkpoint: str, socket_path: str, daemon_pid: int, uri: str | None, report: dict
) -> None:
    """Every round of every method into ``report`` (the daemon at ``socket_path`` holds ``checkpoint``), then the S3
    restart and the N processes if asked."""
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
    if args.processes:
        subprocess.run(
            [sys.executable, "-m", "weightstream.cli", "cache", "evict", "--socket", socket_path, "--json"],
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
        direct = processes(checkpoint, args.processes, {}, None)
        cached = processes(checkpoint, args.processes, {"cache": socket_path}, daemon_pid)
        size = sum(path.stat().st_size for path in Path(checkpoint).glob("*.safetensors"))
        report["processes"] = {
            "count": args.processes,
            "checkpoint_bytes": size,
            "direct": direct,
            "cache": cached,
            "cache_storage_reads_per_copy": cached["storage_read_bytes"] / size,
            "cache_node_memory_per_copy": cached["node_memory_bytes"] / size,
            "direct_storage_reads_per_copy": direct["storage_read_bytes"] / size,
            "direct_node_memory_per_copy": direct["node_memory_bytes"] / size,
            "cache_weights_memory_per_copy": cached["node_memory_for_weights_bytes"] / size,
            "direct_weights_memory_per_copy": direct["node_memory_for_weights_bytes"] / size,
        }


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
        imports="import weightstream, weightstream.nodecache.client",
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
