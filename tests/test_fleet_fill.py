"""Fleet fill between real processes: N nodes (each a process with its own NIXL agent, etcd membership and lease)
filling the same file from a counting HTTP origin read it from the origin about once, each ends with the origin's
bytes, a node that comes later reads nothing from the origin, and a peer serving bad bytes is caught, its pieces read
from the origin again and counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="the fleet's data plane needs NIXL (pip install 'weightstream[fleet]')")

from tests.etcd_server import etcd_server
from tests.rangeserver import RangeServer, replace_file
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
PIECE = 8 * MIB


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> str:
    with etcd_server(tmp_path_factory.mktemp("etcd")) as url:
        yield url


class Node:
    def __init__(self, etcd: str, prefix: str, name: str, url: str, output: Path, *extra: str) -> None:
        self.output = output
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fleet_node", etcd, prefix, name, url, str(output)]
            + ["--piece-bytes", str(PIECE), *extra],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    def stats(self) -> dict[str, int]:
        """Where the node's bytes came from (UCX writes its own error lines to stdout too: they are skipped)."""
        for line in self.process.stdout:  # type: ignore[union-attr]
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(self.process.stderr.read())  # type: ignore[union-attr]

    def leave(self) -> None:
        self.process.stdin.close()  # type: ignore[union-attr]
        code = self.process.wait(timeout=60)
        said = self.process.stderr.read()  # type: ignore[union-attr]
        self.process.stdout.close()  # type: ignore[union-attr]
        self.process.stderr.close()  # type: ignore[union-attr]
        assert code == 0, said


@pytest.fixture
def origin(tmp_path: Path):
    data = os.urandom(MIB) * 40 + os.urandom(8 * MIB)  # 48 MiB: six pieces
    (tmp_path / "origin").mkdir()
    (tmp_path / "origin" / "model.safetensors").write_bytes(data)
    with RangeServer(tmp_path / "origin") as server:
        yield server, f"{server.url}/model.safetensors", data


def test_a_storm_of_three_reads_the_origin_once_and_a_late_joiner_not_at_all(etcd: str, origin, tmp_path: Path):
    server, url, data = origin
    nodes = [Node(etcd, "/storm", f"node-{n}", url, tmp_path / f"node-{n}") for n in range(3)]
    stats = [node.stats() for node in nodes]
    try:
        assert all(node.output.read_bytes() == data for node in nodes)
        assert sum(s["bytes_from_origin"] for s in stats) == len(data), stats
        assert sum(s["bytes_from_peers"] for s in stats) == 2 * len(data), stats
        assert server.ranged_bytes() <= 1.1 * len(data), f"the origin served {server.ranged_bytes()} bytes"
        before = server.ranged_bytes()
        late = Node(etcd, "/storm", "late", url, tmp_path / "late")
        joined = late.stats()
        assert late.output.read_bytes() == data
        assert (joined["bytes_from_origin"], joined["bytes_from_peers"]) == (0, len(data)), joined
        assert server.ranged_bytes() == before, "the late joiner read from the origin"
        late.leave()
    finally:
        for node in nodes:
            node.leave()


def test_a_peer_serving_bad_bytes_is_caught_and_its_piece_read_again(etcd: str, origin, tmp_path: Path):
    _, url, data = origin
    bad = Node(etcd, "/corrupt", "bad", url, tmp_path / "bad", "--corrupt")
    assert bad.stats()["bytes_from_origin"] == len(data)
    try:
        good = Node(etcd, "/corrupt", "good", url, tmp_path / "good")
        filled = good.stats()
        assert good.output.read_bytes() == data, "a corrupted piece was kept"
        assert filled["peer_failures"] == 1 and filled["bytes_refetched"] == PIECE, filled
        assert (filled["pieces_refetched"], filled["pieces_verified"]) == (1, len(data) // PIECE - 1), filled
        assert filled["bytes_from_peers"] == len(data) - PIECE
        good.leave()
    finally:
        bad.leave()


def test_a_peer_killed_mid_storm_costs_only_its_unfinished_pieces(etcd: str, origin, tmp_path: Path):
    server, url, data = origin
    server.misbehave.rate_bytes_per_s = 40e6  # about 1.2 s for the file
    victim = Node(etcd, "/killed", "victim", url, tmp_path / "victim")
    deadline = time.monotonic() + 30
    while server.body_bytes == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    survivors = [Node(etcd, "/killed", f"survivor-{n}", url, tmp_path / f"survivor-{n}") for n in range(2)]
    time.sleep(0.3)
    victim.process.kill()  # mid-storm: its claims and offers go with its lease (5 s)
    victim.process.communicate(timeout=30)
    try:
        stats = [node.stats() for node in survivors]
        assert all(node.output.read_bytes() == data for node in survivors)
        assert server.ranged_bytes() <= 2 * len(data), f"{server.ranged_bytes() / len(data):.2f}x from the origin"
        assert sum(s["bytes_from_origin"] + s["bytes_refetched"] for s in stats) >= len(data) - server.body_bytes
    finally:
        for node in survivors:
            node.leave()


def test_an_origin_that_changes_mid_storm_ends_every_nodes_fill(etcd: str, origin, tmp_path: Path):
    server, url, data = origin
    server.misbehave.rate_bytes_per_s = 10e6  # the first pieces take seconds: the change lands while they move
    replacement = os.urandom(len(data))
    small = ("--piece-bytes", str(2 * MIB))  # 24 pieces: most are asked for after the change (6 move at once)
    nodes = [Node(etcd, "/changed", f"node-{n}", url, tmp_path / f"node-{n}", *small) for n in range(3)]
    deadline = time.monotonic() + 30
    while not any(request.startswith("GET") for request in server.requests) and time.monotonic() < deadline:
        time.sleep(0.005)
    replace_file(server.root / "model.safetensors", replacement)  # the first pieces' reads are under way
    for node in nodes:
        node.process.stdin.close()  # type: ignore[union-attr]
        code = node.process.wait(timeout=120)
        said = node.process.stderr.read()  # type: ignore[union-attr]
        node.process.stdout.close()  # type: ignore[union-attr]
        node.process.stderr.close()  # type: ignore[union-attr]
        assert code != 0, "a node finished a fill of a changed origin"
        assert "SourceChangedError" in said, said[-2000:]
    gateway = EtcdGateway([etcd])
    reports = [gateway.get_held(key) for key in gateway.get_prefix("/changed/failed/")]
    assert reports, "no node reported the change"
    assert all(held is not None and held[1] != 0 for held in reports), "a report of a change that never expires"


def test_a_failed_fill_releases_its_claims_at_once(etcd: str, tmp_path: Path):
    """The origin fails under a node mid-fill: the error is the origin's, and the claims the node held are gone
    while it lives on (another node claims those pieces at once, instead of waiting out the 30 s stall)."""
    import ctypes

    from weightstream.errors import SourceError
    from weightstream.nodecache.daemon.fleet.fill import FleetFill
    from weightstream.nodecache.daemon.fleet.membership import Membership
    from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher, PieceServer

    size = 6 * PIECE
    reads = []

    def failing_origin(offset: int, nbytes: int, address: int) -> None:
        reads.append(offset)
        if len(reads) > 2:
            raise SourceError(f"the origin failed at byte {offset}")
        ctypes.memset(address, 1, nbytes)

    gateway = EtcdGateway([etcd])
    member = Membership(gateway, "/released", "failing", {}, ttl_s=5)
    server, fetcher = PieceServer("failing"), PieceFetcher("failing")
    try:
        fill = FleetFill(member, fetcher, server, piece_bytes=PIECE)
        target = tmp_path / "segment"
        with open(target, "wb+") as file:
            file.truncate(size)
            with pytest.raises(SourceError, match="the origin failed at byte"):
                fill.fill("entry-f", file.fileno(), size, failing_origin)
        assert gateway.get_prefix("/released/pieces/entry-f/") == {}, "a failed fill kept its claims"
        assert gateway.get_prefix("/released/segments/") == {}, "a failed fill is still offered"
        assert set(member.peers()) == {"failing"}, "the node left the fleet (its lease took the claims)"
    finally:
        member.close()
        server.close()
