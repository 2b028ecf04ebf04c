"""Fleet fill between real processes: N nodes (each a process with its own NIXL agent, etcd membership and lease)
filling the same file from a counting HTTP origin read it from the origin about once, each ends with the origin's
bytes, a node that comes later reads nothing from the origin, and a peer serving bad bytes is caught, its pieces read
from the origin again and counted."""

from __future__ import annotations

import json
import os
import re
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
    def __init__(
        self, etcd: str, prefix: str, name: str, url: str, output: Path, *extra: str, env: dict | None = None
    ) -> None:
        self.output = output
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fleet_node", etcd, prefix, name, url, str(output)]
            + ["--piece-bytes", str(PIECE), *extra],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )  # fmt: skip

    def stats(self) -> dict[str, int]:
        """Where the node's bytes came from (UCX writes its own error lines to stdout too: they are skipped)."""
        for line in self.process.stdout:  # type: ignore[union-attr]
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(self.process.stderr.read())  # type: ignore[union-attr]

    def leave(self) -> dict[str, int]:
        """Close the node's stdin: it leaves; the bytes of each entry its peers read from it."""
        self.process.stdin.close()  # type: ignore[union-attr]
        code = self.process.wait(timeout=60)
        said = self.process.stderr.read()  # type: ignore[union-attr]
        lines = [line for line in self.process.stdout if line.startswith('{"served"')]  # type: ignore[union-attr]
        self.process.stdout.close()  # type: ignore[union-attr]
        self.process.stderr.close()  # type: ignore[union-attr]
        assert code == 0, said
        return json.loads(lines[0])["served"] if lines else {}


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


def test_a_wrong_published_digest_is_corrected_from_the_origin_not_reported_as_a_change(
    etcd: str, origin, tmp_path: Path
):
    """A member published a digest that is not of the origin's bytes: the next node's fetch of that piece fails its
    check, the origin's own bytes (read pinned to the version) fail it too, so the digest is corrected and the fill
    ends well; no ``failed/`` report blocks the entry (before: "the origin changed", fleet-wide)."""
    import hashlib

    _, url, data = origin
    holder = Node(etcd, "/wrongdigest", "holder", url, tmp_path / "holder")
    assert holder.stats()["bytes_from_origin"] == len(data)
    gateway = EtcdGateway([etcd])
    (plan,) = gateway.get_prefix("/wrongdigest/plan/")
    entry = plan.rsplit("/", 1)[1]
    gateway.put(f"/wrongdigest/digests/{entry}/2", b"0" * 64)
    try:
        joiner = Node(etcd, "/wrongdigest", "joiner", url, tmp_path / "joiner")
        filled = joiner.stats()
        assert joiner.output.read_bytes() == data
        assert (filled["digests_corrected"], filled["peer_failures"]) == (1, 1), filled
        truth = hashlib.sha256(data[2 * PIECE : 3 * PIECE]).hexdigest().encode()
        assert gateway.get(f"/wrongdigest/digests/{entry}/2") == truth
        assert gateway.get_prefix("/wrongdigest/failed/") == {}, "a wrong digest was reported as a changed origin"
        again = Node(etcd, "/wrongdigest", "again", url, tmp_path / "again")
        assert (again.stats()["peer_failures"], again.output.read_bytes() == data) == (0, True)
        again.leave()
        joiner.leave()
    finally:
        holder.leave()


def test_a_node_that_only_reads_a_failed_report_does_not_write_it_again(etcd: str, origin, tmp_path: Path):
    """One node's report that the origin changed ends the others' fills, and only that node's lease holds it: a
    node whose fill ended on the report alone does not put it again (before: each did, under a fresh lease, so one
    report never ended while anyone retried)."""
    _, url, _ = origin
    gateway = EtcdGateway([etcd])
    reporter = gateway.grant(60)
    probe = Node(etcd, "/report", "probe", url, tmp_path / "probe")  # finds the entry's key
    probe.stats()
    (plan,) = gateway.get_prefix("/report/plan/")
    probe.leave()
    entry = plan.rsplit("/", 1)[1]
    gateway.delete_prefix("/report/")
    gateway.put(f"/report/failed/{entry}", b"seen by another node", reporter)
    reader = Node(etcd, "/report", "reader", url, tmp_path / "reader")
    reader.process.stdin.close()  # type: ignore[union-attr]
    assert reader.process.wait(timeout=60) != 0
    said = reader.process.stderr.read()  # type: ignore[union-attr]
    reader.process.stdout.close()  # type: ignore[union-attr]
    reader.process.stderr.close()  # type: ignore[union-attr]
    assert "another node of the fleet found the origin changed: seen by another node" in said, said[-2000:]
    assert gateway.get_held(f"/report/failed/{entry}") == (b"seen by another node", reporter), "written again"
    gateway.revoke(reporter)


def test_a_failed_fill_releases_its_claims_at_once(etcd: str, tmp_path: Path):
    """The origin fails under a node mid-fill: the error is the origin's, and the claims the node held are gone
    while it lives on (another node claims those pieces at once, instead of waiting out the 30 s stall)."""
    import ctypes

    from weightstream.errors import SourceError
    from weightstream.nodecache.daemon.fleet.fill import FleetFill
    from weightstream.nodecache.daemon.fleet.membership import Membership
    from weightstream.nodecache.daemon.fleet.record_store import RecordStore
    from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher, PieceServer

    size = 6 * PIECE
    reads = []

    def failing_origin(offset: int, nbytes: int, address: int) -> None:
        reads.append(offset)
        if len(reads) > 2:
            raise SourceError(f"the origin failed at byte {offset}")
        ctypes.memset(address, 1, nbytes)

    gateway = EtcdGateway([etcd])
    member = Membership(RecordStore(gateway, "/released"), "failing", ttl_s=5)
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


def test_a_stalled_claim_is_taken_over_by_one_node_which_publishes_its_digest(etcd: str, tmp_path: Path):
    """A live node claimed a piece and never finished it: after the stall a waiting node takes the claim over (one
    transaction on its revision), reads the piece from the origin and publishes its digest, so later nodes fetch it
    from a peer instead of each reading it from the origin (before: read by each, no digest ever published)."""
    import ctypes
    import hashlib

    from weightstream.nodecache.daemon.fleet.fill import FleetFill
    from weightstream.nodecache.daemon.fleet.membership import Membership
    from weightstream.nodecache.daemon.fleet.record_store import RecordStore
    from weightstream.nodecache.daemon.fleet.records import Claim
    from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher, PieceServer

    size = 3 * PIECE

    def origin(offset: int, nbytes: int, address: int) -> None:
        ctypes.memset(address, offset // PIECE + 1, nbytes)

    gateway = EtcdGateway([etcd])
    stalled = Membership(RecordStore(gateway, "/stalled"), "stuck", ttl_s=30)
    member = Membership(RecordStore(gateway, "/stalled"), "waiting", ttl_s=5)
    server, fetcher = PieceServer("waiting"), PieceFetcher("waiting")
    try:
        gateway.put("/stalled/pieces/entry-s/1", Claim("stuck", "claimed").encode(), stalled.lease)
        fill = FleetFill(member, fetcher, server, piece_bytes=PIECE, stall_s=1.0)
        with open(tmp_path / "segment", "wb+") as file:
            file.truncate(size)
            stats = fill.fill("entry-s", file.fileno(), size, origin)
            file.seek(PIECE)
            assert file.read(PIECE) == b"\x02" * PIECE
        assert (stats.claims_taken_over, stats.bytes_from_origin, stats.pieces_refetched) == (1, size, 0), stats
        digest = hashlib.sha256(b"\x02" * PIECE).hexdigest()
        held = gateway.get_held("/stalled/pieces/entry-s/1")
        assert held == (Claim("waiting", "done", digest).encode(), member.lease), held
        assert gateway.get("/stalled/digests/entry-s/1") == digest.encode()
    finally:
        member.close()
        stalled.close()
        server.close()
        gateway.delete_prefix("/stalled/")


def test_a_claim_that_does_not_parse_is_taken_over_after_the_stall_not_waited_on_for_ever(etcd: str, tmp_path: Path):
    """A junk value at a piece's claim key (no lease: it never goes by itself) holds the piece like a stalled claim:
    after the stall the waiting node takes it over on its revision and fills every piece (before: the claim was
    skipped as unparsable and could never be made, so the fill waited for that piece for ever)."""
    import ctypes
    import hashlib

    from weightstream.nodecache.daemon.fleet.fill import FleetFill
    from weightstream.nodecache.daemon.fleet.membership import Membership
    from weightstream.nodecache.daemon.fleet.record_store import RecordStore
    from weightstream.nodecache.daemon.fleet.records import Claim
    from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher, PieceServer

    size = 3 * PIECE

    def origin(offset: int, nbytes: int, address: int) -> None:
        ctypes.memset(address, offset // PIECE + 1, nbytes)

    gateway = EtcdGateway([etcd])
    store = RecordStore(gateway, "/junkclaim")
    member = Membership(store, "waiting", ttl_s=5)
    server, fetcher = PieceServer("waiting"), PieceFetcher("waiting")
    try:
        gateway.put("/junkclaim/pieces/entry-j/2", b'\xff{"node": ')
        fill = FleetFill(member, fetcher, server, piece_bytes=PIECE, stall_s=1.0)
        with open(tmp_path / "segment", "wb+") as file:
            file.truncate(size)
            started = time.monotonic()
            stats = fill.fill("entry-j", file.fileno(), size, origin)
            took = time.monotonic() - started
            file.seek(0)
            assert file.read() == b"\x01" * PIECE + b"\x02" * PIECE + b"\x03" * PIECE
        assert took >= 1.0, f"the junk claim was not waited on for the stall ({took:.2f} s)"
        assert (stats.claims_taken_over, stats.bytes_from_origin) == (1, size), stats
        assert store.bad_records >= 1
        digest = hashlib.sha256(b"\x03" * PIECE).hexdigest()
        held = gateway.get_held("/junkclaim/pieces/entry-j/2")
        assert held == (Claim("waiting", "done", digest).encode(), member.lease), held
    finally:
        member.close()
        server.close()
        gateway.delete_prefix("/junkclaim/")


def test_a_frozen_peer_costs_one_deadline_and_its_late_delivery_lands_in_fenced_memory(
    etcd: str, origin, tmp_path: Path
):
    """The only holder is frozen (SIGSTOP, its lease still alive): the joiner's transfers from it run at once, each
    with its own deadline, so the fill ends about one deadline later (before: one at a time under one lock, four
    deadlines). A transfer past its deadline may still land (releasing it only cancels the request: the holder
    answers when it resumes), so the fill is abandoned with MemoryStillInUseError (the daemon fills a fresh file from
    the origin) and the memory is fenced off. Thawed, the holder delivers: the joiner lives on (before: the late
    bytes landed in memory unmapped or mapped to another segment since, a segfault or a corrupt segment), the file
    holds none of the holder's bytes (its copy is marked), and the transfers, once over, are released with the
    fenced memory. The holder forgotten meanwhile (as a failed fetch forgets a peer) is dropped only after them: its
    agent removed under a transfer still under way crashed a daemon when the peer answered (the soak)."""
    import signal

    _, url, data = origin
    tcp = {"UCX_TLS": "tcp"}  # as between machines: on one host UCX reads a stopped peer's memory itself (CMA)
    holder = Node(etcd, "/frozen", "holder", url, tmp_path / "holder", "--ttl", "120", "--corrupt", env=tcp)
    assert holder.stats()["bytes_from_origin"] == len(data)
    os.kill(holder.process.pid, signal.SIGSTOP)
    try:
        timeout = 8.0
        started = time.monotonic()
        joiner = Node(etcd, "/frozen", "joiner", url, tmp_path / "joiner", "--piece-timeout", str(timeout), env=tcp)
        abandoned = joiner.stats()
        took = time.monotonic() - started
        assert re.search(r"not delivered in 8 s; the read may still land", abandoned["stuck"]), abandoned
        assert abandoned["kept"] >= 1, abandoned
        assert took < 3 * timeout, f"{took:.1f} s: the transfers waited for each other (each deadline {timeout} s)"
        joiner.process.stdin.write("forget holder\n")  # type: ignore[union-attr]  # as a failed fetch does
        joiner.process.stdin.flush()  # type: ignore[union-attr]
        assert joiner.stats()["kept"] == abandoned["kept"], "the kept transfers went before they ended"
    finally:
        os.kill(holder.process.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    kept = abandoned["kept"]
    while kept and time.monotonic() < deadline:
        time.sleep(0.5)
        joiner.process.stdin.write("reap\n")  # type: ignore[union-attr]
        joiner.process.stdin.flush()  # type: ignore[union-attr]
        kept = joiner.stats()["kept"]
    assert kept == 0, "the late transfers were never seen to end"
    assert joiner.process.poll() is None, joiner.process.stderr.read()  # type: ignore[union-attr]
    written = joiner.output.read_bytes()[4096 : 4096 + 64]  # the holder's copy has 0xff there (--corrupt)
    assert written != b"\xff" * 64, "the late transfer wrote into the abandoned file"
    joiner.leave()
    holder.leave()


def test_past_the_fill_deadline_the_pieces_still_claimed_elsewhere_come_from_the_origin(etcd: str, tmp_path: Path):
    """A live node holds a piece's claim and never finishes it; the stall is long (10 min) but the fill's deadline
    short: at the deadline the waiting node reads the piece from the origin without taking the claim (counted as
    past the deadline), and the fill ends bit-exact."""
    import ctypes

    from weightstream.nodecache.daemon.fleet.fill import FleetFill
    from weightstream.nodecache.daemon.fleet.membership import Membership
    from weightstream.nodecache.daemon.fleet.record_store import RecordStore
    from weightstream.nodecache.daemon.fleet.records import Claim
    from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher, PieceServer

    size = 3 * PIECE

    def origin(offset: int, nbytes: int, address: int) -> None:
        ctypes.memset(address, offset // PIECE + 1, nbytes)

    gateway = EtcdGateway([etcd])
    stalled = Membership(RecordStore(gateway, "/deadline"), "stuck", ttl_s=30)
    member = Membership(RecordStore(gateway, "/deadline"), "waiting", ttl_s=5)
    server, fetcher = PieceServer("waiting"), PieceFetcher("waiting")
    try:
        gateway.put("/deadline/pieces/entry-d/0", Claim("stuck", "claimed").encode(), stalled.lease)
        fill = FleetFill(member, fetcher, server, piece_bytes=PIECE, stall_s=600.0, deadline=lambda size: 1.0)
        with open(tmp_path / "segment", "wb+") as file:
            file.truncate(size)
            stats = fill.fill("entry-d", file.fileno(), size, origin)
            file.seek(0)
            assert file.read() == b"\x01" * PIECE + b"\x02" * PIECE + b"\x03" * PIECE
        assert (stats.pieces_past_deadline, stats.claims_taken_over, stats.bytes_from_origin) == (1, 0, size), stats
        held = gateway.get_held("/deadline/pieces/entry-d/0")
        assert held == (Claim("stuck", "claimed").encode(), stalled.lease), "the claim was taken, not waited past"
    finally:
        member.close()
        stalled.close()
        server.close()
        gateway.delete_prefix("/deadline/")


def test_a_transfer_that_cannot_be_released_fences_its_memory_off_and_abandons_the_fill(
    etcd: str, origin, tmp_path: Path
):
    """NIXL refuses to release a transfer (it could not be cancelled, so it may still write): the fill fails with
    MemoryStillInUseError naming the bytes, the memory it reads into stays mapped as private zero pages that never
    map the segment file again (a late write lands there, not in the file, nor in a later mapping), and the rest of
    the fill's mapping is gone; the node's offer of the entry is withdrawn."""
    from weightstream.errors import MemoryStillInUseError
    from weightstream.nodecache.daemon.fleet.fill import FleetFill
    from weightstream.nodecache.daemon.fleet.membership import Membership
    from weightstream.nodecache.daemon.fleet.record_store import RecordStore
    from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher, PieceServer

    _, url, data = origin
    holder = Node(etcd, "/stuck", "holder", url, tmp_path / "holder")
    assert holder.stats()["bytes_from_origin"] == len(data)
    gateway = EtcdGateway([etcd])
    member = Membership(RecordStore(gateway, "/stuck"), "joiner", ttl_s=5)
    server, fetcher = PieceServer("joiner"), PieceFetcher("joiner")
    release = fetcher._agent.release_xfer_handle
    refused = []

    def refuse_once(handle) -> None:
        if not refused:
            refused.append(handle)
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        release(handle)

    fetcher._agent.release_xfer_handle = refuse_once
    try:
        entry = gateway.get_prefix("/stuck/complete/").popitem()[0].split("/")[3]
        fill = FleetFill(member, fetcher, server, piece_bytes=PIECE)
        segment = tmp_path / "segment"
        with open(segment, "wb+") as file:
            file.truncate(len(data))
            with pytest.raises(MemoryStillInUseError, match=r"could not be stopped: the 8388608 bytes it reads into"):
                fill.fill(entry, file.fileno(), len(data), lambda *_: pytest.fail("the origin was read"))
        assert len(fetcher.stuck) == 1 and fetcher.stuck[0][1] == PIECE, fetcher.stuck
        fenced = fetcher.stuck[0][0]
        maps = Path("/proc/self/maps").read_text().splitlines()
        assert not [line for line in maps if str(segment) in line], "the fill's mapping of the file is still there"
        spans = [line.split()[:2] for line in maps]
        assert any(int(span.split("-")[0], 16) <= fenced < int(span.split("-")[1], 16) and perms == "rw-p"
                   for span, perms in spans), "the fenced memory was unmapped"  # fmt: skip
        assert gateway.get_prefix(f"/stuck/segments/{entry}/joiner") == {}, "the abandoned fill is still offered"
    finally:
        member.close()
        server.close()
        holder.leave()
        gateway.delete_prefix("/stuck/")


def test_bytes_served_are_counted_from_the_readers_notices_and_a_bad_notice_is_skipped(tmp_path: Path):
    """A reader's agent tells the server's, as each read ends, what it read (NIXL's notification of a one-sided
    read): the server counts it per entry with no etcd key; a notice that is not a count (here an entry name that is
    not one) is skipped and counted, logged once."""
    import ctypes
    import mmap

    from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher, PieceServer

    size = 2 * PIECE
    (tmp_path / "segment").write_bytes(os.urandom(size))
    server, fetcher = PieceServer("serving"), PieceFetcher("reading")
    into = mmap.mmap(-1, size)
    try:
        with open(tmp_path / "segment", "rb") as file:
            where = server.publish("entry-n", file.fileno(), size)
        address = ctypes.addressof(ctypes.c_char.from_buffer(into))
        fetcher.read("serving", where, 0, PIECE, address, served_as="entry-n")
        fetcher.read("serving", where, PIECE, PIECE, address + PIECE, served_as="entry-n")
        fetcher.read("serving", where, 0, PIECE, address, served_as="../evil")
        deadline = time.monotonic() + 30
        while (server.served(), server.bad_notices) != ({"entry-n": size}, 1):
            assert time.monotonic() < deadline, (server.served(), server.bad_notices)
            time.sleep(0.05)
        assert into[:] == (tmp_path / "segment").read_bytes()
    finally:
        server.close()
        into.close()
