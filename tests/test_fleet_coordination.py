"""The fleet's coordination through a real etcd (Debian's 3.4, started by the tests): nodes under leases, one claim
per piece among racing processes, a dead node's claims gone with its lease, a live node's kept past it, two fleets
on one etcd never mixed, etcd out of reach a typed error, and the gateway's kept connection replaced when etcd
restarts."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.etcd_server import etcd_server
from weightstream.errors import CacheConfigError, FleetUnavailableError
from weightstream.nodecache.daemon.fleet.claims import Claims
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway
from weightstream.nodecache.daemon.fleet.membership import Membership
from weightstream.nodecache.daemon.fleet.record_store import RecordStore
from weightstream.nodecache.daemon.fleet.records import Claim, NodeRecord

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> str:
    with etcd_server(tmp_path_factory.mktemp("etcd")) as url:
        yield url


def claimer(etcd: str, prefix: str, node: str, entry: str, pieces: int, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.fleet_claimer", etcd, prefix, node, entry, str(pieces), *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_racing_nodes_each_piece_is_won_by_exactly_one(etcd: str):
    processes = [claimer(etcd, "/race", f"node-{n}", "entry-a", 64, "--hold") for n in range(4)]
    try:
        won = {f"node-{number}": json.loads(process.stdout.readline()) for number, process in enumerate(processes)}
    finally:
        for process in processes:
            process.kill()
            process.communicate(timeout=30)
    claimed = sorted(piece for pieces in won.values() for piece in pieces)
    assert claimed == list(range(64)), f"a piece claimed twice, or not at all: {won}"
    holders = Claims(RecordStore(EtcdGateway([etcd]), "/race"), "observer", lambda: 0).pieces("entry-a")
    assert {piece: claim.node for piece, (claim, _) in holders.items()} == {
        piece: node for node, pieces in won.items() for piece in pieces
    }


def test_a_killed_nodes_claims_expire_with_its_lease_and_a_live_ones_outlast_it(etcd: str):
    gateway = EtcdGateway([etcd])
    dying = claimer(etcd, "/expiry", "dying", "entry-b", 4, "--hold")
    assert json.loads(dying.stdout.readline()) == [0, 1, 2, 3]
    living = Membership(RecordStore(gateway, "/expiry"), "living", ttl_s=3)
    try:
        mine = Claims(RecordStore(gateway, "/expiry"), "living", lambda: living.lease)
        assert mine.claim("entry-c", 0) == (True, Claim("living", "claimed"))
        assert mine.claim("entry-b", 0) == (False, Claim("dying", "claimed"))
        dying.kill()
        dying.communicate(timeout=30)
        deadline = time.monotonic() + 15
        while mine.pieces("entry-b") and time.monotonic() < deadline:
            time.sleep(0.25)
        assert mine.pieces("entry-b") == {}, "a dead node's claims outlived its lease"
        assert mine.claim("entry-b", 0)[0], "the piece could not be claimed again"
        assert set(living.peers()) == {"living"}
        time.sleep(4)  # longer than the lease: the renewing thread keeps it
        assert [claim for claim, _ in mine.pieces("entry-c").values()] == [Claim("living", "claimed")]
        mine.done("entry-c", 0, "ab" * 32)
        assert [claim for claim, _ in mine.pieces("entry-c").values()] == [Claim("living", "done", "ab" * 32)]
        mine.release_all("entry-b", mine.mine("entry-b"))
        assert mine.pieces("entry-b") == {}
    finally:
        living.close()
    assert gateway.get_prefix("/expiry/") == {}, "leaving the fleet left keys behind"


def test_two_fleets_on_one_etcd_never_mix(etcd: str):
    gateway = EtcdGateway([etcd])
    first = Membership(RecordStore(gateway, "/fleet-a"), "node-1")
    second = Membership(RecordStore(gateway, "/fleet-b"), "node-1")
    try:
        assert Claims(first.store, "node-1", lambda: first.lease).claim("same-entry", 0)[0]
        assert Claims(second.store, "node-1", lambda: second.lease).claim("same-entry", 0)[0]
        assert first.peers() == second.peers() == {"node-1": NodeRecord("node-1")}
        assert first.lease != second.lease
    finally:
        first.close()
        second.close()


def test_etcd_out_of_reach_is_a_typed_error_naming_every_endpoint(tmp_path: Path):
    from tests.objstore import free_port

    endpoints = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    with pytest.raises(FleetUnavailableError) as refused:
        Membership(RecordStore(EtcdGateway(endpoints), "/nowhere"), "node")
    message = str(refused.value)
    assert message.startswith("no etcd endpoint answered /v3/lease/grant: ")
    assert all(endpoint in message for endpoint in endpoints) and "ConnectionRefusedError" in message
    with pytest.raises(CacheConfigError, match=r"etcd endpoint 'etcd\.example:2379': not http://HOST:PORT"):
        EtcdGateway(["etcd.example:2379"])


def test_the_gateway_answers_to_something_else_are_refused(tmp_path: Path):
    """A server that is not etcd (a plain HTTP server answering HTML) is refused, not taken for an empty store."""
    import http.server
    import threading

    class NotEtcd(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>hello</html>")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotEtcd)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(FleetUnavailableError, match=r"/v3/kv/range: HTTP 200, not etcd's JSON: b'<html>hello"):
            EtcdGateway([f"http://127.0.0.1:{server.server_address[1]}"]).get("/key")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_an_answer_that_trickles_fails_at_the_whole_request_deadline(monkeypatch: pytest.MonkeyPatch):
    """A server that sends its answer a byte at a time, each well inside the silence timeout, is given up at the
    whole-request deadline (before: every fleet call, ``cache fleet`` included, hung for as long as it trickled);
    the watchdog's thread ends when no request is under way, and the socket is closed."""
    import http.server
    import threading

    from weightstream.nodecache.daemon.fleet import etcd as etcd_module

    monkeypatch.setattr(etcd_module, "REQUEST_DEADLINE_S", 1.5)
    monkeypatch.setattr(etcd_module, "WATCHDOG_LINGER_S", 0.2)
    stop = threading.Event()

    class Trickling(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            while not stop.wait(0.2):
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    return

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickling)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]

    def watchdogs() -> int:
        return sum(thread.name == "weightstream-etcd-deadline" for thread in threading.enumerate())

    before = watchdogs()  # other tests' gateways may still have theirs for a moment
    try:
        gateway = EtcdGateway([f"http://127.0.0.1:{port}"])
        started = time.monotonic()
        with pytest.raises(FleetUnavailableError, match=r"/v3/kv/range: .*TimeoutError: no whole answer in 2 s"):
            gateway.get("/key")
        assert 1.4 < time.monotonic() - started < 5, "not the whole-request deadline"
        deadline = time.monotonic() + 5
        while watchdogs() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watchdogs() <= before, "the watchdog's thread stayed"
        assert connections_to(port) == [], "the given-up connection was kept"
        gateway.close()
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
        thread.join()


def connections_to(port: int) -> list[str]:
    """The TCP states of this process's sockets connected to ``port`` on this machine (``01``: established)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    states = []
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == port and fields[9] in inodes:
            states.append(fields[3])
    return states


def test_calls_share_one_connection_and_a_restarted_etcd_is_reached_on_a_new_one(tmp_path: Path):
    """Calls one after another go over one kept connection (over TLS a new one costs a handshake on both sides);
    when etcd restarts, the kept one is dead and the next call goes on a new one, the dead one closed; ``close``
    closes what is kept."""
    from tests.objstore import free_port

    port = free_port()
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    with etcd_server(tmp_path / "first", client_port=port) as url:
        gateway = EtcdGateway([url])
        for number in range(20):
            gateway.put(f"/kept/{number}", b"x")
        assert len(gateway.get_prefix("/kept/")) == 20
        assert connections_to(port) == ["01"], "not one connection for calls one after another"
    with etcd_server(tmp_path / "second", client_port=port):
        assert gateway.get_prefix("/kept/") == {}, "not the new etcd's (empty) answer"
        assert connections_to(port) == ["01"], "the dead connection was not closed"
        gateway.close()
        assert connections_to(port) == []
