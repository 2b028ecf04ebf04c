"""A fleet of separate "machines": each daemon in a network namespace of its own behind a rate-limited veth link, the
origin behind a slower one (a throttled bucket), etcd on the hub. The loads run on their nodes; every byte between
nodes crosses the links (NIXL over UCX's TCP on each node's ``eth0``, as between real machines), and the links'
counters show it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="the fleet's data plane needs NIXL (pip install 'weightstream[fleet]')")

from tests import netns

if netns.available() is not None:
    pytest.skip(f"separate machines need network namespaces: {netns.available()}", allow_module_level=True)

import weightstream
from tests.cache_daemon import Daemon, remove, stats
from tests.cache_daemon import places as cache_places
from tests.conftest import assert_same
from tests.etcd_server import etcd_server
from tests.rangeserver import RangeServer
from tests.test_fleet_daemons import origin_file, read_once

ROOT = Path(__file__).resolve().parents[1]
NODE_MBIT = 1000
ORIGIN_MBIT = 400
UCX_ON_THE_LINK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
"""Between real machines UCX has no shared memory: here it must not find any either, or bytes would skip the links."""


@contextlib.contextmanager
def daemon_on(network: netns.Network, machine: netns.Machine, fleet: str) -> Iterator[Daemon]:
    directory, socket_path = cache_places(machine.namespace[-6:])
    name = machine.namespace.removeprefix(f"ws{network.token}")
    daemon = Daemon(
        directory, socket_path, "--fleet", fleet, "--fleet-node", name,
        wrap=lambda command: machine.command(command, PYTHONPATH=str(ROOT), **UCX_ON_THE_LINK),
    )  # fmt: skip
    try:
        with daemon:
            yield daemon
    finally:
        remove(directory, socket_path)


def load_on(network: netns.Network, machine: netns.Machine, url: str, daemon: Daemon) -> dict:
    with network.inside(machine):
        return weightstream.load_weights(url, cache=str(daemon.socket))


def test_nodes_on_their_own_links_read_the_origin_once(tmp_path: Path):
    state, size = origin_file(tmp_path, 1024, 21)
    with contextlib.ExitStack() as stack:
        network = stack.enter_context(netns.Network())
        origin_machine = network.machine("origin", mbit=ORIGIN_MBIT)
        nodes = [network.machine(f"node{number}", mbit=NODE_MBIT) for number in range(4)]
        etcd = stack.enter_context(etcd_server(tmp_path, network))
        with network.inside(origin_machine):
            origin = stack.enter_context(RangeServer(tmp_path / "origin", host=origin_machine.address))
        fleet = etcd.replace("http://", "etcd://") + "/machines"
        daemons = [stack.enter_context(daemon_on(network, node, fleet)) for node in nodes]
        url = f"{origin.url}/model.safetensors"
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            loads = [pool.submit(load_on, network, node, url, daemon) for node, daemon in zip(nodes, daemons[:3])]
            for load in loads:
                assert_same(load.result(), state)
        served, fleets = read_once(origin, size, daemons[:3])
        for node, daemon_fleet in zip(nodes, fleets):
            assert network.received_bytes(node) >= daemon_fleet["bytes_from_origin"] + daemon_fleet["bytes_from_peers"]

        before = network.received_bytes(nodes[3])
        assert_same(load_on(network, nodes[3], url, daemons[3]), state)
        late = stats(daemons[3].socket)["fleet"]
        assert (late["bytes_from_origin"], late["bytes_from_peers"]) == (0, size), late
        assert origin.ranged_bytes() == served, "the late machine read from the origin"
        assert network.received_bytes(nodes[3]) - before >= size, "the peer bytes did not cross the late node's link"

        listed = subprocess.run(
            ["ip", "netns", "exec", network.hub, sys.executable, "-m", "weightstream.cli", "cache", "fleet",
             "--fleet", fleet, "--json"],
            capture_output=True, text=True, timeout=60, check=True, cwd=ROOT,
        )  # fmt: skip
        assert sorted(json.loads(listed.stdout)["nodes"]) == [f"node{number}" for number in range(4)]
    assert network.namespaces() == [], "namespaces left behind"
