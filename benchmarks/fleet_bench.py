"""Fleet fill against N independent fills, from an origin capped like a throttled bucket: origin bytes per node and the
time until all N nodes hold the checkpoint, for N = 1, 2, 4; then a late joiner's fill against the peer link.

    python benchmarks/fleet_bench.py --size 256MiB --origin-mbps 100 --nodes 1,2,4 --rounds 3 \\
        --json benchmarks/fleet.json --plot benchmarks/fleet.png

Every node is a real `weightstream cache serve` process (with `--fleet` for the fleet rows, without for the
independent ones), every load a `load_weights(..., cache=its socket)` at the same moment; etcd is Debian's, the origin
an HTTP range server of the tests' own serving at most ``--origin-mbps`` MB/s in all. Medians of ``--rounds``.
The peer link's capacity is a NIXL read of the whole file between two processes, measured in the same run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import weightstream
from tests.cache_daemon import Daemon, remove, stats
from tests.cache_daemon import places as cache_places
from tests.etcd_server import etcd_server
from tests.rangeserver import RangeServer
from weightstream.arguments import parse_size
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.save.write import write_safetensors


@contextlib.contextmanager
def daemons(count: int, fleet: str | None, tag: str) -> Iterator[list[Daemon]]:
    """``count`` daemons on fresh places, in the fleet ``fleet`` (an etcd:// URL) or in none."""
    started, places = [], []
    try:
        for number in range(count):
            places.append(cache_places(f"{tag}{number}"))
            extra = ("--fleet", fleet, "--fleet-node", f"{tag}-{number}") if fleet else ()
            started.append(Daemon(*places[-1], *extra).start())
        yield started
    finally:
        for daemon in started:
            daemon.stop()
        for directory, socket_path in places:
            remove(directory, socket_path)


def storm(group: list[Daemon], url: str) -> float:
    """Seconds until a load through every daemon of ``group``, all started at once, has every tensor."""
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(group)) as pool:
        loads = [pool.submit(weightstream.load_weights, url, cache=str(daemon.socket)) for daemon in group]
        for load in loads:
            load.result()
    return time.perf_counter() - started


def peer_link_seconds(path: Path) -> float:
    """One NIXL read of the whole file from another process (the link a late joiner fetches over)."""
    import ctypes
    import mmap
    import os
    import subprocess

    from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher

    info = path.with_suffix(".where.json")
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.fleet_holder", str(path), "link-holder", str(info)], cwd=ROOT
    )
    try:
        while not info.exists():
            time.sleep(0.05)
        where = json.loads(info.read_text())
        size = os.path.getsize(path)
        buffer = mmap.mmap(-1, size)
        address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        fetcher = PieceFetcher("link-reader")
        fetcher.read("link-holder", where, 0, 1 << 20, address)  # connect first
        started = time.perf_counter()
        fetcher.read("link-holder", where, 0, size, address)
        return time.perf_counter() - started
    finally:
        holder.kill()
        holder.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=256 << 20)
    parser.add_argument("--origin-mbps", type=float, default=100.0)
    parser.add_argument("--nodes", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]
    results: dict = {"size": 0, "origin_mbps": args.origin_mbps, "rounds": args.rounds, "nodes": {}}
    with tempfile.TemporaryDirectory(prefix="ws-fleet-bench-") as scratch:
        root = Path(scratch)
        (root / "origin").mkdir()
        shape = LlamaShape.of_size(args.size, layers=2)
        write_safetensors(str(root / "origin" / "model.safetensors"), llama_state_dict(shape), {"format": "pt"})
        size = (root / "origin" / "model.safetensors").stat().st_size
        results["size"] = size
        with etcd_server(root) as etcd, RangeServer(root / "origin") as origin:
            origin.misbehave.rate_bytes_per_s = args.origin_mbps * 1e6
            url = f"{origin.url}/model.safetensors"
            for count in counts:
                rows: dict[str, list[float]] = {"fleet_s": [], "fleet_origin": [], "alone_s": [], "alone_origin": []}
                for round_number in range(args.rounds):
                    fleet = etcd.replace("http://", "etcd://") + f"/bench-{count}-{round_number}"
                    for label, address in (("fleet", fleet), ("alone", None)):
                        with daemons(count, address, f"{label}{count}r{round_number}") as group:
                            before = origin.body_bytes
                            seconds = storm(group, url)
                            rows[f"{label}_s"].append(seconds)
                            rows[f"{label}_origin"].append((origin.body_bytes - before) / size)
                    print(
                        f"N={count} round {round_number + 1}: fleet {rows['fleet_s'][-1]:.2f} s, "
                        f"{rows['fleet_origin'][-1]:.2f}x from the origin; independent {rows['alone_s'][-1]:.2f} s, "
                        f"{rows['alone_origin'][-1]:.2f}x",
                        flush=True,
                    )
                results["nodes"][count] = {key: statistics.median(values) for key, values in rows.items()}
            single = results["nodes"].get(1, {}).get("alone_s")
            for row in results["nodes"].values():
                row["fleet_vs_one_node"] = row["fleet_s"] / single if single else None
            with daemons(2, etcd.replace("http://", "etcd://") + "/late", "late") as pair:
                storm(pair[:1], url)
                before = origin.body_bytes
                late_s = storm(pair[1:], url)
                late_origin = origin.body_bytes - before
                late_peer = stats(pair[1].socket)["fleet"]["peer_bytes"]
            link_s = peer_link_seconds(root / "origin" / "model.safetensors")
            results["late_joiner"] = {
                "seconds": late_s,
                "origin_bytes": late_origin,
                "peer_bytes": late_peer,
                "peer_link_seconds": link_s,
                "vs_peer_link": link_s / late_s,
            }
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


def plot(results: dict, path: str) -> None:
    """Origin bytes per checkpoint and time until all nodes hold it, fleet vs independent, against N (linear)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted(results["nodes"], key=int)
    rows = [results["nodes"][count] for count in counts]
    figure, (origin_axis, time_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for label, key in (("fleet", "fleet"), ("independent fills", "alone")):
        origin_axis.plot(counts, [row[f"{key}_origin"] for row in rows], marker="o", label=label)
        time_axis.plot(counts, [row[f"{key}_s"] for row in rows], marker="o", label=label)
    origin_axis.set(xlabel="nodes", ylabel="origin bytes / checkpoint bytes", title="origin bytes")
    time_axis.set(xlabel="nodes", ylabel="seconds until every node holds it", title="time")
    for axis in (origin_axis, time_axis):
        axis.set_ylim(bottom=0)
        axis.legend()
    figure.suptitle(f"{results['size'] / 2**20:.0f} MiB from an origin capped at {results['origin_mbps']:.0f} MB/s")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
