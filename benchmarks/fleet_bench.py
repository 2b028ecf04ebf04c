"""Fleet fill against N independent fills, from an origin capped like a throttled bucket: origin bytes per node and the
time until all N nodes hold the checkpoint, for N = 1, 2, 4, 8; then a late joiner's fill against the peer link.

    python benchmarks/fleet_bench.py --size 256MiB --origin-mbps 100 --link-mbps 250 --nodes 1,2,4,8 --rounds 3 \\
        --json benchmarks/fleet.json --plot benchmarks/fleet.png

Every node is a real `weightstream cache serve` process (with `--fleet` for the fleet rows, without for the
independent ones) on a "machine" of its own: a network namespace behind a veth link limited to ``--link-mbps`` MB/s
each way with ``tc`` (NIXL over UCX's TCP on that link, no shared memory between nodes). The origin, an HTTP range
server of the tests' own, sits on a machine whose link is limited to ``--origin-mbps`` (a throttled bucket); etcd
(Debian's) on the hub. Every load is a `load_weights(..., cache=its socket)` run on its node, all at the same moment.
Medians of ``--rounds``. The peer link's capacity is a NIXL read of the whole file between two node machines, in the
same run. ``--loopback`` puts everything on this host's loopback instead (the origin paced by the server itself,
peers free to use shared memory), where namespaces cannot be made.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import weightstream
from tests import netns
from tests.cache_daemon import Daemon, remove, stats
from tests.cache_daemon import places as cache_places
from tests.etcd_server import etcd_server
from tests.rangeserver import RangeServer
from weightstream.arguments import parse_size
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.save.write import write_safetensors

UCX_ON_THE_LINK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}


class Hosts:
    """Where the nodes run: machines of a :class:`tests.netns.Network` (``network``), or this host (None)."""

    def __init__(self, network: netns.Network | None, link_mbps: float, count: int) -> None:
        self.network = network
        self.machines = [network.machine(f"node{n}", mbit=link_mbps * 8) for n in range(count)] if network else []

    def wrap(self, number: int) -> Callable[[list[str]], list[str]] | None:
        """How node ``number``'s processes are started."""
        if self.network is None:
            return None
        machine = self.machines[number]
        return lambda command: machine.command(command, PYTHONPATH=str(ROOT), **UCX_ON_THE_LINK)

    def on(self, number: int) -> contextlib.AbstractContextManager[None]:
        """This thread on node ``number`` (its network namespace)."""
        return self.network.inside(self.machines[number]) if self.network else contextlib.nullcontext()


@contextlib.contextmanager
def daemons(hosts: Hosts, count: int, fleet: str | None, tag: str, first: int = 0) -> Iterator[list[Daemon]]:
    """``count`` daemons on fresh places on nodes ``first``.., in the fleet ``fleet`` (an etcd:// URL) or in none."""
    started, places = [], []
    try:
        for number in range(first, first + count):
            places.append(cache_places(f"{tag}{number}"))
            extra = ("--fleet", fleet, "--fleet-node", f"{tag}-{number}") if fleet else ()
            started.append(Daemon(*places[-1], *extra, wrap=hosts.wrap(number)).start())
        yield started
    finally:
        for daemon in started:
            daemon.stop()
        for directory, socket_path in places:
            remove(directory, socket_path)


def storm(hosts: Hosts, group: list[Daemon], url: str, first: int = 0) -> float:
    """Seconds until a load through every daemon of ``group`` (on nodes ``first``..), all started at once, has every
    tensor."""

    def load(number: int, daemon: Daemon) -> None:
        with hosts.on(number):
            weightstream.load_weights(url, cache=str(daemon.socket))

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(group)) as pool:
        loads = [pool.submit(load, first + n, daemon) for n, daemon in enumerate(group)]
        for future in loads:
            future.result()
    return time.perf_counter() - started


def peer_link_seconds(hosts: Hosts, path: Path) -> float:
    """One NIXL read of the whole file by node 1 from node 0 (the link a late joiner fetches over)."""
    info = path.with_suffix(".where.json")
    holder_command = [sys.executable, "-m", "tests.fleet_holder", str(path), "link-holder", str(info)]
    reader_command = [sys.executable, "-m", "tests.fleet_reader", "link-holder", str(info), str(path.stat().st_size)]
    holder_wrap, reader_wrap = hosts.wrap(0), hosts.wrap(1)
    holder = subprocess.Popen(holder_wrap(holder_command) if holder_wrap else holder_command, cwd=ROOT)
    try:
        while not info.exists():
            time.sleep(0.05)
        read = subprocess.run(
            reader_wrap(reader_command) if reader_wrap else reader_command,
            cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        return json.loads(read.stdout.strip().splitlines()[-1])["seconds"]
    finally:
        holder.kill()
        holder.wait()
        info.unlink(missing_ok=True)


def throttled_origin(
    stack: contextlib.ExitStack, network: netns.Network | None, root: Path, mbps: float
) -> RangeServer:
    """An HTTP range server of ``root`` capped at ``mbps`` MB/s (a throttled bucket), open until ``stack`` closes: on
    a machine of its own behind a link of that rate, or on loopback paced by the server itself."""
    if network is None:
        origin = stack.enter_context(RangeServer(root))
        origin.misbehave.rate_bytes_per_s = mbps * 1e6
        return origin
    machine = network.machine("origin", mbit=mbps * 8)
    with network.inside(machine):
        return stack.enter_context(RangeServer(root, host=machine.address))


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: daemons, namespaces and etcd still go
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=256 << 20)
    parser.add_argument("--origin-mbps", type=float, default=100.0)
    parser.add_argument("--link-mbps", type=float, default=250.0)
    parser.add_argument("--loopback", action="store_true")
    parser.add_argument("--nodes", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]
    results: dict = {
        "size": 0,
        "origin_mbps": args.origin_mbps,
        "link_mbps": None if args.loopback else args.link_mbps,
        "machines": "loopback" if args.loopback else "network namespaces",
        "rounds": args.rounds,
        "nodes": {},
    }
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="ws-fleet-bench-"))
        root = Path(scratch)
        (root / "origin").mkdir()
        shape = LlamaShape.of_size(args.size, layers=2)
        write_safetensors(str(root / "origin" / "model.safetensors"), llama_state_dict(shape), {"format": "pt"})
        size = (root / "origin" / "model.safetensors").stat().st_size
        results["size"] = size
        network = None if args.loopback else stack.enter_context(netns.Network())
        hosts = Hosts(network, args.link_mbps, max(max(counts), 2))
        etcd = stack.enter_context(etcd_server(root, network))
        origin = throttled_origin(stack, network, root / "origin", args.origin_mbps)
        url = f"{origin.url}/model.safetensors"
        for count in counts:
            rows: dict[str, list[float]] = {"fleet_s": [], "fleet_origin": [], "alone_s": [], "alone_origin": []}
            for round_number in range(args.rounds):
                fleet = etcd.replace("http://", "etcd://") + f"/bench-{count}-{round_number}"
                for label, address in (("fleet", fleet), ("alone", None)):
                    with daemons(hosts, count, address, f"{label}{count}r{round_number}") as group:
                        before = origin.body_bytes
                        seconds = storm(hosts, group, url)
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
        with daemons(hosts, 2, etcd.replace("http://", "etcd://") + "/late", "late") as pair:
            storm(hosts, pair[:1], url)
            before = origin.body_bytes
            late_s = storm(hosts, pair[1:], url, first=1)
            late_origin = origin.body_bytes - before
            late_peer = stats(pair[1].socket)["fleet"]["bytes_from_peers"]
        link_s = peer_link_seconds(hosts, root / "origin" / "model.safetensors")
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

    by_count = {int(count): row for count, row in results["nodes"].items()}  # str keys once read back from JSON
    counts = sorted(by_count)
    rows = [by_count[count] for count in counts]
    figure, (origin_axis, time_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for label, key in (("fleet", "fleet"), ("independent fills", "alone")):
        origin_axis.plot(counts, [row[f"{key}_origin"] for row in rows], marker="o", label=label)
        time_axis.plot(counts, [row[f"{key}_s"] for row in rows], marker="o", label=label)
    origin_axis.set(xlabel="nodes", ylabel="origin bytes / checkpoint bytes", title="origin bytes")
    time_axis.set(xlabel="nodes", ylabel="seconds until every node holds it", title="time")
    for axis in (origin_axis, time_axis):
        axis.set_ylim(bottom=0)
        axis.legend()
    links = f", nodes on {results['link_mbps']:.0f} MB/s links" if results.get("link_mbps") else " (loopback)"
    figure.suptitle(
        f"{results['size'] / 2**20:.0f} MiB from an origin capped at {results['origin_mbps']:.0f} MB/s{links}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
