"""The fleet as operators run it, for a bounded while: nodes with room for two of five checkpoints, clients loading
random ones, a node killed (SIGKILL) and restarted every few minutes, a peer frozen (SIGSTOP) for a while, etcd
restarted once; every load checked bit-exact, and what the node leaves behind measured at the start and the end.

    python benchmarks/fleet_soak.py --minutes 20 --json benchmarks/fleet_soak.json

Every node is a real `weightstream cache serve --fleet` process on a "machine" of its own (a network namespace behind
a ``tc``-limited veth link, as ``benchmarks/fleet_bench.py``; ``--loopback`` runs them on this host's loopback), the
origin an HTTP range server behind a link of its own, etcd (Debian's) on the hub. One client per node loads a random
checkpoint through its node's socket, checks every tensor's sha256 against the checkpoint's, drops it and loads the
next; a load that meets its node down (killed, not yet restarted) waits for it and is counted as such. Reported:
loads, bit-exact loads, failures by type, the slowest load against one origin read, origin bytes per load, and at
the start and the end: ``/dev/shm`` used, each daemon's fds and threads, the fleet's etcd keys.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import hashlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import weightstream
from benchmarks.fleet_bench import Hosts, throttled_origin
from tests import netns
from tests.cache_daemon import Daemon, remove
from tests.cache_daemon import places as cache_places
from tests.etcd_server import etcd_server
from tests.objstore import free_port
from weightstream.arguments import parse_size
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.errors import CacheUnavailableError
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway
from weightstream.save.write import write_safetensors


def digests_of(tensors: dict) -> dict[str, str]:
    """Each tensor's sha256 (of its bytes as laid out, contiguous)."""
    return {
        name: hashlib.sha256(ctypes.string_at(tensor.contiguous().data_ptr(), tensor.nbytes)).hexdigest()
        for name, tensor in tensors.items()
    }


def process_counts(pid: int) -> tuple[int, int]:
    """(open fds, threads) of process ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def fd_kinds(pid: int) -> dict[str, int]:
    """Process ``pid``'s open fds by what they are (``socket``, ``anon_inode:[eventfd]``, a file's directory...)."""
    families = {}
    for family in ("unix", "tcp", "tcp6", "udp"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{family}").read_text().splitlines()[1:]:
                fields = line.split()
                inode = fields[6] if family == "unix" else fields[9]
                state = (
                    "" if family == "unix" else f" {int(fields[3], 16):02d} to port {int(fields[2].split(':')[1], 16)}"
                )
                families[inode] = family + state
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:"):
                kind = "socket " + families.get(target[8:-1], "other")
            else:
                kind = target.split(":", 1)[0] if target.startswith("pipe:") else target.rsplit("/", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def shm_used() -> int:
    stat = os.statvfs("/dev/shm")
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


class Node:
    """One daemon of the soak, restartable on its places."""

    def __init__(self, hosts: Hosts, number: int, fleet: str, budget: int) -> None:
        self.hosts, self.number = hosts, number
        self.places = cache_places(f"soak{number}")
        self.extra = ("--fleet", fleet, "--fleet-node", f"soak-{number}", "--budget", str(budget))
        self.daemon: Daemon | None = None
        self.up = threading.Event()

    def start(self) -> None:
        self.daemon = Daemon(*self.places, *self.extra, wrap=self.hosts.wrap(self.number)).start()
        self.up.set()

    def kill(self) -> None:
        self.up.clear()
        assert self.daemon is not None
        self.daemon.kill()

    def exited_by_itself(self) -> int | None:
        """The exit status of a daemon that ended when nobody stopped it (None while it runs)."""
        process = self.daemon.process if self.daemon is not None else None
        return None if process is None or not self.up.is_set() else process.poll()

    def log_tail(self, lines: int = 40) -> list[str]:
        """The last warnings and errors of the daemon's log (its info lines, each fill, would drown them)."""
        said = self.daemon.log().splitlines() if self.daemon is not None else []
        return [line for line in said if ": INFO: " not in line][-lines:]

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.process is not None and self.daemon.process.poll() is None:
            self.daemon.stop()
        remove(*self.places)


class Results:
    """What the clients saw, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds: list[float] = []
        self.spans: list[tuple[int, float, float]] = []
        """Each load's node, start and end (monotonic)."""
        self.exact = 0
        self.mismatched = 0
        self.failures: dict[str, int] = {}
        self.first_failures: dict[str, str] = {}
        """The first message of each type of failure."""
        self.waited_for_node = 0
        self.mismatches: list[dict] = []
        """Each load that was not bit-exact: its node, checkpoint, start and the tensors that differed."""

    def add(self, node: int, started: float, seconds: float, differing: list[str], checkpoint: int) -> None:
        with self.lock:
            self.seconds.append(seconds)
            self.spans.append((node, started, started + seconds))
            self.exact += not differing
            self.mismatched += bool(differing)
            if differing:
                self.mismatches.append(
                    {"node": node, "checkpoint": checkpoint, "started": started, "tensors": differing[:5]}
                )

    def fail(self, error: BaseException) -> None:
        with self.lock:
            name = type(error).__name__
            self.failures[name] = self.failures.get(name, 0) + 1
            self.first_failures.setdefault(name, str(error)[:500])


def client(node: Node, urls: list[str], digests: list[dict[str, str]], until: float, seed: int, out: Results) -> None:
    """Load random checkpoints through ``node`` until ``until``; each checked against its digests. The client runs
    on the node's machine (its namespace): it asks the origin for the file's version itself."""
    with node.hosts.on(node.number):
        _client(node, urls, digests, until, random.Random(seed), out)


def _client(
    node: Node, urls: list[str], digests: list[dict[str, str]], until: float, chooser: random.Random, out: Results
) -> None:
    while time.monotonic() < until:
        if not node.up.wait(timeout=1.0):
            continue
        number = chooser.randrange(len(urls))
        started = time.monotonic()
        try:
            tensors = weightstream.load_weights(urls[number], cache=str(node.places[1]))
        except CacheUnavailableError as error:
            if not node.up.is_set():  # killed under the load: it waits for the restart
                with out.lock:
                    out.waited_for_node += 1
                continue
            out.fail(error)
            time.sleep(0.1)
            continue
        except Exception as error:  # noqa: BLE001 - counted by type: the report says what failed
            out.fail(error)
            time.sleep(0.1)  # counts episodes, not how fast a refusal comes back
            continue
        seconds = time.monotonic() - started
        got = digests_of(tensors)
        differing = sorted(
            name for name in digests[number].keys() | got.keys() if got.get(name) != digests[number].get(name)
        )
        out.add(node.number, started, seconds, differing, number)
        del tensors
        gc.collect()  # the segment is no longer mapped here: the node may evict it


def hit(node: int, begin: float, end: float, disturbed: list[tuple[int, float, float]]) -> bool:
    """Whether a load through ``node`` from ``begin`` to ``end`` met its node killed or frozen."""
    return any(node == number and begin < to and end > since for number, since, to in disturbed)


def snapshot(nodes: list[Node], gateway: EtcdGateway, prefix: str, network: netns.Network | None) -> dict:
    """What the nodes hold now: ``/dev/shm`` used, each daemon's fds and threads, the fleet's keys in etcd."""
    counts = [process_counts(node.daemon.process.pid) for node in nodes]  # type: ignore[union-attr]
    with network.inside() if network else contextlib.nullcontext():  # etcd answers on the hub only
        keys = len(gateway.get_prefix(prefix + "/"))
    return {
        "dev_shm_bytes": shm_used(),
        "fds": [fds for fds, _ in counts],
        "fd_kinds": [fd_kinds(node.daemon.process.pid) for node in nodes],  # type: ignore[union-attr]
        "threads": [threads for _, threads in counts],
        "etcd_keys": keys,
    }


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--checkpoints", type=int, default=5)
    parser.add_argument("--size", type=parse_size, default=48 << 20, help="each checkpoint's size")
    parser.add_argument("--origin-mbps", type=float, default=100.0)
    parser.add_argument("--link-mbps", type=float, default=250.0)
    parser.add_argument("--kill-every-s", type=float, default=180.0)
    parser.add_argument("--freeze-s", type=float, default=60.0)
    parser.add_argument("--loopback", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    duration = args.minutes * 60
    events: list[str] = []
    results = Results()
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ws-fleet-soak-")))
        (root / "origin").mkdir()
        shape = LlamaShape.of_size(args.size, layers=2)
        digests = []
        for number in range(args.checkpoints):
            state = llama_state_dict(shape, seed=100 + number)
            write_safetensors(str(root / "origin" / f"model-{number}.safetensors"), state, {"format": "pt"})
            digests.append(digests_of(state))
            del state
        size = (root / "origin" / "model-0.safetensors").stat().st_size
        network = None if args.loopback else stack.enter_context(netns.Network())
        hosts = Hosts(network, args.link_mbps, args.nodes)
        port = free_port()
        (root / "etcd").mkdir()
        etcd_stack = contextlib.ExitStack()
        etcd = etcd_stack.enter_context(etcd_server(root / "etcd", network, client_port=port))
        stack.callback(lambda: etcd_stack.close())
        origin = throttled_origin(stack, network, root / "origin", args.origin_mbps)
        urls = [f"{origin.url}/model-{number}.safetensors" for number in range(args.checkpoints)]
        prefix = "/soak"
        fleet = etcd.replace("http://", "etcd://") + prefix
        budget = size * 5 // 2  # two checkpoints, not three
        nodes = [Node(hosts, number, fleet, budget) for number in range(args.nodes)]
        for node in nodes:
            stack.callback(node.stop)
            node.start()
        gateway = EtcdGateway([etcd])
        started = time.monotonic()
        one_origin_read = args.size / (args.origin_mbps * 1e6)
        before = snapshot(nodes, gateway, prefix, network)
        origin_before = origin.body_bytes
        until = started + duration
        clients = [
            threading.Thread(target=client, args=(node, urls, digests, until, args.seed + n, results), daemon=True)
            for n, node in enumerate(nodes)
        ]
        for thread in clients:
            thread.start()
        kill_at = started + args.kill_every_s
        freeze_at, etcd_at = started + duration * 0.3, started + duration * 0.55
        victim = 0
        disturbed: list[tuple[int, float, float]] = []
        """(node, from, to): while a node was killed or frozen, its own loads could only wait."""
        exits: list[dict] = []
        """Daemons that ended by themselves: when, their status and their log's last lines (each restarted, as an
        init system would)."""
        while time.monotonic() < until:
            now = time.monotonic()
            for node in nodes:
                code = node.exited_by_itself()
                if code is not None:
                    node.up.clear()
                    exits.append(
                        {"node": node.number, "at_s": round(now - started), "status": code, "log": node.log_tail()}
                    )
                    events.append(f"{now - started:.0f} s: node {node.number} exited by itself (status {code})")
                    node.start()
                    disturbed.append((node.number, now, time.monotonic()))
            if now >= kill_at:
                node = nodes[victim % len(nodes)]
                node.kill()
                events.append(f"{now - started:.0f} s: node {node.number} killed (SIGKILL)")
                time.sleep(3)
                node.start()
                events.append(f"{time.monotonic() - started:.0f} s: node {node.number} restarted")
                disturbed.append((node.number, now, time.monotonic()))
                victim, kill_at = victim + 1, now + args.kill_every_s
            elif freeze_at and now >= freeze_at:
                frozen = nodes[-1]
                assert frozen.daemon is not None and frozen.daemon.process is not None
                frozen.up.clear()  # its own clients wait (a frozen daemon answers no one): its peers are tried
                os.kill(frozen.daemon.process.pid, signal.SIGSTOP)
                events.append(f"{now - started:.0f} s: node {frozen.number} frozen (SIGSTOP)")
                time.sleep(min(args.freeze_s, max(0.0, until - time.monotonic())))
                os.kill(frozen.daemon.process.pid, signal.SIGCONT)
                frozen.up.set()
                events.append(f"{time.monotonic() - started:.0f} s: node {frozen.number} thawed")
                disturbed.append((frozen.number, now, time.monotonic()))
                freeze_at = 0.0
            elif etcd_at and now >= etcd_at:
                etcd_stack.close()
                events.append(f"{now - started:.0f} s: etcd stopped")
                time.sleep(5)
                etcd_stack = contextlib.ExitStack()
                etcd_stack.enter_context(etcd_server(root / "etcd", network, client_port=port))
                events.append(f"{time.monotonic() - started:.0f} s: etcd restarted (same data, same port)")
                etcd_at = 0.0
            else:
                time.sleep(0.5)
        for thread in clients:
            thread.join(timeout=600)
        for node in nodes:  # settled: every load over, leases renewed, nothing in flight
            node.up.wait(timeout=60)
        time.sleep(5)
        after = snapshot(nodes, gateway, prefix, network)
        loads = len(results.seconds)
        report = {
            "minutes": args.minutes,
            "nodes": args.nodes,
            "checkpoints": args.checkpoints,
            "checkpoint_bytes": size,
            "budget_bytes": budget,
            "machines": "loopback" if network is None else "network namespaces",
            "origin_mbps": args.origin_mbps,
            "link_mbps": None if network is None else args.link_mbps,
            "etcd": etcd,
            "origin": origin.url,
            "events": events,
            "loads": loads,
            "bit_exact": results.exact,
            "mismatched": results.mismatched,
            "mismatches": [
                {**mismatch, "started": round(mismatch["started"] - started, 1)} for mismatch in results.mismatches
            ],
            "failures": results.failures,
            "first_failures": results.first_failures,
            "daemons_that_exited_by_themselves": exits,
            "loads_that_met_their_node_down": results.waited_for_node,
            "median_load_s": statistics.median(results.seconds) if loads else None,
            "slowest_load_s": max(results.seconds) if loads else None,
            "slowest_load_on_a_node_up_throughout_s": max(
                (end - begin for node, begin, end in results.spans if not hit(node, begin, end, disturbed)),
                default=None,
            ),
            "one_origin_read_s": one_origin_read,
            "origin_bytes_per_load": (origin.body_bytes - origin_before) / loads if loads else None,
            "checkpoint_bytes_per_load": size,
            "start": before,
            "end": after,
        }
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if loads and results.mismatched == 0 and not results.failures and not exits else 1


if __name__ == "__main__":
    sys.exit(main())
