"""Cache daemons in a fleet, as real processes (`weightstream cache serve --fleet etcd://...`): loads through three
daemons at once read the file from a counting HTTP origin about once, a daemon joining later reads nothing from it,
every load is the origin's bytes, and `stats` says where each daemon's bytes came from."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="the fleet's data plane needs NIXL (pip install 'weightstream[fleet]')")

from safetensors.torch import save_file

import weightstream
from tests.cache_daemon import Daemon, remove, request, stats
from tests.cache_daemon import places as cache_places
from tests.conftest import assert_same
from tests.etcd_server import certificates, etcd_server
from tests.rangeserver import RangeServer
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway

ROOT = Path(__file__).resolve().parents[1]


def origin_file(tmp_path: Path, hidden: int, seed: int) -> tuple[dict, int]:
    """A two-layer Llama checkpoint ``hidden`` wide in ``tmp_path/origin/model.safetensors``: its tensors and size."""
    state = llama_state_dict(LlamaShape(hidden, round(hidden * 2.75 / 256) * 256, 2, 4000), seed=seed)
    (tmp_path / "origin").mkdir()
    save_file(state, str(tmp_path / "origin" / "model.safetensors"))
    return state, (tmp_path / "origin" / "model.safetensors").stat().st_size


@dataclasses.dataclass
class Fleet:
    """An etcd, an HTTP origin serving ``tmp_path/origin``, and places for daemons, for one test."""

    url: str
    """The fleet's ``etcd://.../PREFIX``."""
    etcd: str
    origin: RangeServer
    file: str
    """The origin's URL of ``model.safetensors``."""
    places: dict[str, tuple[Path, Path]]

    def daemon(self, name: str, *extra: str) -> Daemon:
        """A daemon of this fleet named ``name`` (``with`` it), on places of its own kept across restarts."""
        if name not in self.places:
            self.places[name] = cache_places(f"fleet{name}")
        return Daemon(*self.places[name], "--fleet", self.url, "--fleet-node", name, *extra)


@contextlib.contextmanager
def fleet_of(tmp_path: Path, prefix: str) -> Iterator[Fleet]:
    places: dict[str, tuple[Path, Path]] = {}
    try:
        with etcd_server(tmp_path) as etcd, RangeServer(tmp_path / "origin") as origin:
            url = etcd.replace("http://", "etcd://") + prefix
            yield Fleet(url, etcd, origin, f"{origin.url}/model.safetensors", places)
    finally:
        for place in places.values():
            remove(*place)


def read_once(origin: RangeServer, size: int, daemons: list[Daemon]) -> tuple[int, list[dict]]:
    """After ``daemons`` loaded a ``size``-byte file at once: the origin served about one copy, their own counts say
    one copy came from it and every other from peers. The origin's ranged bytes and each daemon's fleet counts."""
    served = origin.ranged_bytes()
    assert served <= 1.1 * size, f"the origin served {served / size:.2f}x the file to {len(daemons)} daemons"
    fleets = [stats(daemon.socket)["fleet"] for daemon in daemons]
    assert sum(f["bytes_from_origin"] for f in fleets) == size, fleets
    assert sum(f["bytes_from_peers"] for f in fleets) == (len(daemons) - 1) * size, fleets
    return served, fleets


def cpu_seconds(pid: int) -> float:
    """CPU time process ``pid`` has used (user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


UNPARSABLE = [
    ("pieces/{entry}/999", b"{not json"),
    ("pieces/{entry}/x\udcff", b'{"node": "node-0", "state": "done", "sha256": "00"}'),
    ("digests/{entry}/998", b"\xff\xfe"),
    ("complete/{entry}/evil", b'{"address": "0x10", "size": 1}'),
    ("segments/{entry}/evil", b"[]"),
    ("devices/{entry}/evil/GPU-0", b'{"address": 1, "size": 1, "metadata": "zz", "gpu": "GPU-0"}'),
    ("nodes/evil", b'{"node": 7}'),
    ("nodes/a b", b'{"node": "a b"}'),
]
"""Records no member writes, one (or two) per family: the late node's fill and ``cache fleet`` skip them."""


def test_three_daemons_read_the_origin_once_and_a_fourth_not_at_all(tmp_path: Path):
    state, size = origin_file(tmp_path, 1024, 12)
    daemons: list[Daemon] = []
    places = []
    with etcd_server(tmp_path) as etcd, RangeServer(tmp_path / "origin") as origin:
        fleet = etcd.replace("http://", "etcd://") + "/daemons"
        try:
            for number in range(4):
                places.append(cache_places(f"fleet{number}"))
                daemon = Daemon(*places[-1], "--fleet", fleet, "--fleet-node", f"node-{number}")
                daemons.append(daemon.start())
            url = f"{origin.url}/model.safetensors"
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                loads = [
                    pool.submit(weightstream.load_weights, url, cache=str(daemon.socket)) for daemon in daemons[:3]
                ]
                for load in loads:
                    assert_same(load.result(), state)
            served, _ = read_once(origin, size, daemons[:3])
            (entry,) = stats(daemons[0].socket)["fleet"]["entries"]
            gateway = EtcdGateway([etcd])
            for family, value in UNPARSABLE:  # a broken member's writes in every family: skipped, counted
                gateway.put(f"/daemons/{family.format(entry=entry)}", value)
            assert_same(weightstream.load_weights(url, cache=str(daemons[3].socket)), state)
            late = stats(daemons[3].socket)["fleet"]
            assert (late["bytes_from_origin"], late["bytes_from_peers"]) == (0, size), late
            assert late["bad_records"] >= 4, late  # the claims, digest and complete ones its fill read
            assert origin.ranged_bytes() == served, "the late daemon read from the origin"
            deadline = time.monotonic() + 30  # each read's notice reaches its server as the read ends
            while sum(stats(daemon.socket)["fleet"]["bytes_served_to_peers"] for daemon in daemons) < 3 * size:
                assert time.monotonic() < deadline, [stats(daemon.socket)["fleet"] for daemon in daemons]
                time.sleep(0.1)
            everyone = [stats(daemon.socket)["fleet"] for daemon in daemons]
            assert sum(f["bytes_served_to_peers"] for f in everyone) == 3 * size, everyone
            assert everyone[3]["bytes_served_to_peers"] == 0, "the late daemon served bytes it had not been asked for"
            for counts in everyone:
                (entry,) = counts["entries"].values()
                assert entry["bytes_from_origin"] + entry["bytes_from_peers"] == size, counts
                assert entry["bytes_served_to_peers"] == counts["bytes_served_to_peers"], counts
            assert gateway.get_prefix("/daemons/served/") == {}, "served counts are in etcd again"
            listed = subprocess.run(
                [sys.executable, "-m", "weightstream.cli", "cache", "fleet", "--fleet", fleet, "--json"],
                capture_output=True, text=True, timeout=60, check=True, cwd=ROOT,
            )  # fmt: skip
            nodes = json.loads(listed.stdout)["nodes"]
            assert sorted(nodes) == [f"node-{n}" for n in range(4)]
            assert all(len(held["complete"]) == 1 and held["filling"] == [] for held in nodes.values()), nodes
            assert "skipped" in listed.stderr, listed.stderr  # the junk nodes (logged, not listed)
            idle = cpu_seconds(daemons[0].process.pid)
            time.sleep(3)
            spent = (cpu_seconds(daemons[0].process.pid) - idle) / 3
            assert spent < 0.2, f"an idle fleet daemon kept {spent:.0%} of a CPU busy (a spinning progress thread?)"
        finally:
            for daemon in daemons:
                daemon.stop()
            for directory, socket_path in places:
                remove(directory, socket_path)


def test_a_fleet_without_etcd_is_refused_at_start(tmp_path: Path):
    from tests.objstore import free_port

    directory, socket_path = cache_places("fleetless")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "weightstream.cli", "cache", "serve", "--dir", str(directory), "--socket",
             str(socket_path), "--fleet", f"etcd://127.0.0.1:{free_port()}/nowhere"],
            capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
        )  # fmt: skip
        assert result.returncode == 1
        assert result.stderr.startswith("weightstream: error: no etcd endpoint answered /v3/lease/grant: ")
        assert not os.path.exists(socket_path)
        bad = subprocess.run(
            [sys.executable, "-m", "weightstream.cli", "cache", "serve", "--dir", str(directory), "--socket",
             str(socket_path), "--fleet", "http://127.0.0.1:2379"],
            capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
        )  # fmt: skip
        assert bad.returncode == 1 and "not etcd://HOST:PORT[/PREFIX]" in bad.stderr
    finally:
        remove(directory, socket_path)


def test_a_fleet_on_etcd_over_tls_takes_only_nodes_with_a_certificate(tmp_path: Path):
    """etcd answering only clients whose certificate its CA signed (``--client-cert-auth``): a daemon with the CA and
    a node's certificate joins (``etcds://``, ``--fleet-ca``, ``--fleet-cert``, ``--fleet-key``) and fills through
    it, and ``cache fleet`` lists it; one without a certificate, or trusting only the system's CAs, is refused at
    start with the TLS failure."""
    state, size = origin_file(tmp_path, 256, 14)
    tls = certificates(tmp_path)
    place = cache_places("fleettls")
    try:
        with etcd_server(tmp_path, certificates=tls) as etcd, RangeServer(tmp_path / "origin") as origin:
            fleet = etcd.replace("https://", "etcds://") + "/tls"
            credentials = ["--fleet-ca", str(tls.ca), "--fleet-cert", str(tls.node), "--fleet-key", str(tls.node_key)]
            with Daemon(*place, "--fleet", fleet, "--fleet-node", "secure", *credentials) as daemon:
                url = f"{origin.url}/model.safetensors"
                assert_same(weightstream.load_weights(url, cache=str(daemon.socket)), state)
                assert stats(daemon.socket)["fleet"]["bytes_from_origin"] == size
                listed = subprocess.run(
                    [sys.executable, "-m", "weightstream.cli", "cache", "fleet", "--fleet", fleet, *credentials,
                     "--json"],
                    capture_output=True, text=True, timeout=60, check=True, cwd=ROOT,
                )  # fmt: skip
                nodes = json.loads(listed.stdout)["nodes"]
                assert list(nodes) == ["secure"] and len(nodes["secure"]["complete"]) == 1, nodes
            refusals = (
                # etcd's alert (TLS 1.2, 1.3), or its closing the connection before the alert is read
                (credentials[:2], ("ALERT_BAD_CERTIFICATE", "ALERT_CERTIFICATE_REQUIRED", "SSLEOFError")),
                ([], ("CERTIFICATE_VERIFY_FAILED",)),
            )
            for given, why in refusals:
                refused = subprocess.run(
                    [sys.executable, "-m", "weightstream.cli", "cache", "serve", "--dir", str(place[0]), "--socket",
                     str(place[1]), "--fleet", fleet, *given],
                    capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
                )  # fmt: skip
                assert refused.returncode == 1, refused.stderr
                assert refused.stderr.startswith("weightstream: error: no etcd endpoint answered /v3/lease/grant: ")
                assert any(alert in refused.stderr for alert in why), refused.stderr
                assert not place[1].exists()
    finally:
        remove(*place)


def test_etcd_lost_during_a_fill_finishes_it_from_the_origin(tmp_path: Path):
    """The fleet's etcd stopped while a daemon fills from a slow origin: the load still gets every byte (the fill
    finished from the origin alone, counted), and the daemon goes on serving."""
    state, _ = origin_file(tmp_path, 1024, 13)
    directory, socket_path = cache_places("etcdlost")
    with contextlib.ExitStack() as etcd_running, RangeServer(tmp_path / "origin") as origin:
        etcd = etcd_running.enter_context(etcd_server(tmp_path))
        origin.misbehave.rate_bytes_per_s = 15e6  # about 3 s for the file
        try:
            with Daemon(directory, socket_path, "--fleet", etcd.replace("http://", "etcd://") + "/lost") as daemon:
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    load = pool.submit(
                        weightstream.load_weights, f"{origin.url}/model.safetensors", cache=str(daemon.socket)
                    )
                    deadline = time.monotonic() + 30
                    while origin.body_bytes == 0 and time.monotonic() < deadline:
                        time.sleep(0.05)
                    etcd_running.close()  # etcd stops mid-fill
                    assert_same(load.result(timeout=120), state)
                assert stats(daemon.socket)["fleet"]["fills_without_fleet"] == 1
                assert "the fleet's etcd went away" in daemon.log()
        finally:
            remove(directory, socket_path)


def test_a_node_whose_budget_cannot_hold_the_file_refuses_and_the_others_go_on(tmp_path: Path):
    from weightstream.errors import CacheFullError

    state, _ = origin_file(tmp_path, 512, 14)
    with (
        fleet_of(tmp_path, "/budget") as fleet,
        fleet.daemon("small", "--budget", "1MiB") as tight,
        fleet.daemon("roomy") as ample,
    ):
        with pytest.raises(CacheFullError):
            weightstream.load_weights(fleet.file, cache=str(tight.socket))
        assert_same(weightstream.load_weights(fleet.file, cache=str(ample.socket)), state)
        assert stats(tight.socket)["fleet"]["bytes_from_origin"] == 0


def test_a_restarted_daemon_offers_what_it_adopted(tmp_path: Path):
    """A daemon of the fleet restarted on its directory adopts its segments and offers them again: a second daemon
    then fills from it, reading nothing from the origin but its HEAD."""
    state, size = origin_file(tmp_path, 512, 15)
    with fleet_of(tmp_path, "/restart") as fleet:
        with fleet.daemon("first") as daemon:
            assert_same(weightstream.load_weights(fleet.file, cache=str(daemon.socket)), state)
        served = fleet.origin.ranged_bytes()
        with fleet.daemon("first") as restarted, fleet.daemon("second") as joiner:
            assert restarted.status["adopted"] == 1
            assert_same(weightstream.load_weights(fleet.file, cache=str(joiner.socket)), state)
            assert stats(joiner.socket)["fleet"]["bytes_from_peers"] == size
            assert fleet.origin.ranged_bytes() == served, "the joiner read the file from the origin"


def test_a_daemon_whose_lease_expired_offers_its_files_again(tmp_path: Path):
    """A daemon that could not renew its lease for longer than it lasts (stopped here with SIGSTOP) registers again
    and puts its offers back under the new lease: a second daemon then fills from it, not from the origin."""
    import signal

    from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway

    state, size = origin_file(tmp_path, 512, 16)
    with fleet_of(tmp_path, "/reoffer") as fleet, fleet.daemon("paused") as paused:
        gateway = EtcdGateway([fleet.etcd])
        assert_same(weightstream.load_weights(fleet.file, cache=str(paused.socket)), state)
        served = fleet.origin.ranged_bytes()
        os.kill(paused.process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while gateway.get_prefix("/reoffer/complete/") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert gateway.get_prefix("/reoffer/complete/") == {}, "the paused node's lease did not expire"
        os.kill(paused.process.pid, signal.SIGCONT)
        while not gateway.get_prefix("/reoffer/complete/") and time.monotonic() < deadline + 30:
            time.sleep(0.2)
        with fleet.daemon("after") as after:
            assert_same(weightstream.load_weights(fleet.file, cache=str(after.socket)), state)
            assert stats(after.socket)["fleet"]["bytes_from_peers"] == size
        assert fleet.origin.ranged_bytes() == served, "the second daemon read the file from the origin"
        assert "registering again" in paused.log()


def test_a_daemon_whose_name_was_taken_while_it_was_away_stays_out_of_the_fleet(tmp_path: Path):
    """A daemon's lease expires (SIGSTOP) and another daemon starts with its name: when the first wakes it does not
    take the name back, logs why, shows it in ``stats`` and fills from the origin alone (counted); the second keeps
    the name under its own lease and fills from the fleet as usual."""
    import signal

    from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway

    state, size = origin_file(tmp_path, 512, 18)
    with fleet_of(tmp_path, "/taken") as fleet, fleet.daemon("twin") as away:
        gateway = EtcdGateway([fleet.etcd])
        os.kill(away.process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while gateway.get_prefix("/taken/nodes/") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert gateway.get_prefix("/taken/nodes/") == {}, "the stopped daemon's lease did not expire"
        with fleet.daemon("taker", "--fleet-node", "twin") as taker:
            _, lease = gateway.get_held("/taken/nodes/twin")
            os.kill(away.process.pid, signal.SIGCONT)
            while "stays out of the fleet" not in away.log() and time.monotonic() < deadline + 30:
                time.sleep(0.2)
            assert "a live node of the fleet has this name" in away.log(), away.log()[-2000:]
            status = stats(away.socket)["fleet"]
            assert "a live node of the fleet has this name" in status["out_of_fleet"], status
            assert_same(weightstream.load_weights(fleet.file, cache=str(away.socket)), state)
            assert stats(away.socket)["fleet"]["fills_without_fleet"] == 1
            assert fleet.origin.ranged_bytes() >= size
            assert_same(weightstream.load_weights(fleet.file, cache=str(taker.socket)), state)
            taken = stats(taker.socket)["fleet"]
            assert (taken["bytes_from_origin"], taken["bytes_from_peers"]) == (size, 0), "the away daemon offers"
            assert gateway.get_held("/taken/nodes/twin")[1] == lease, "the name changed hands again"
            assert taken["out_of_fleet"] is None


def test_a_daemon_killed_and_restarted_at_once_on_its_directory_takes_its_own_place_back(tmp_path: Path):
    """SIGKILL, then the same daemon (same directory, same name) started again before its old lease expired: it is
    its own dead predecessor (its directory's lock went with it), so it takes the name back (the old lease revoked,
    logged) instead of being refused for ten seconds, and offers what it adopted: a second daemon fills from it."""
    from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway

    state, size = origin_file(tmp_path, 512, 19)
    with fleet_of(tmp_path, "/phoenix") as fleet:
        gateway = EtcdGateway([fleet.etcd])
        with fleet.daemon("phoenix") as first:
            assert_same(weightstream.load_weights(fleet.file, cache=str(first.socket)), state)
            old = gateway.get_held("/phoenix/nodes/phoenix")
            first.kill()
        served = fleet.origin.ranged_bytes()
        with fleet.daemon("phoenix") as again, fleet.daemon("other") as other:
            assert "previous daemon on this directory died" in again.log(), again.log()[-2000:]
            held = gateway.get_held("/phoenix/nodes/phoenix")
            assert held is not None and held[1] != old[1], "the dead daemon's lease still holds the name"
            assert again.status["adopted"] == 1
            assert_same(weightstream.load_weights(fleet.file, cache=str(other.socket)), state)
            assert stats(other.socket)["fleet"]["bytes_from_peers"] == size
            assert fleet.origin.ranged_bytes() == served, "the second daemon read the file from the origin"


def test_an_s3_origin_is_read_once_by_two_daemons(s3_endpoint, tmp_path: Path):
    """The same fleet fill from a real S3 server (SeaweedFS): the pieces are read from it once in all, the versions
    pinned by ETag, each daemon's load exact."""
    from tests.objstore import put

    state = llama_state_dict(LlamaShape(hidden=1024, intermediate=2816, layers=2, vocab=4000), seed=17)
    save_file(state, str(tmp_path / "model.safetensors"))
    size = (tmp_path / "model.safetensors").stat().st_size
    put("s3", tmp_path / "model.safetensors", "fleet/model.safetensors")
    places = [cache_places("fleets3a"), cache_places("fleets3b")]
    try:
        with etcd_server(tmp_path) as etcd:
            fleet = etcd.replace("http://", "etcd://") + "/s3"
            with (
                Daemon(*places[0], "--fleet", fleet, "--fleet-node", "a") as first,
                Daemon(*places[1], "--fleet", fleet, "--fleet-node", "b") as second,
                concurrent.futures.ThreadPoolExecutor(2) as pool,
            ):
                loads = [
                    pool.submit(weightstream.load_weights, "s3://bench/fleet/model.safetensors", cache=str(d.socket))
                    for d in (first, second)
                ]
                for load in loads:
                    assert_same(load.result(), state)
                fleets = [stats(daemon.socket)["fleet"] for daemon in (first, second)]
            assert sum(f["bytes_from_origin"] for f in fleets) == size, fleets
            assert sum(f["bytes_from_peers"] for f in fleets) == size, fleets
    finally:
        for place in places:
            remove(*place)


def test_an_s3_checksum_catches_a_peer_lying_about_a_piece(s3_endpoint, tmp_path: Path):
    """An object uploaded with a SHA-256 checksum: a member of the fleet changes a piece of its copy and publishes that
    piece's digest, the piece passes it, the object's own checksum does not, and the file is read from S3 again."""
    import hashlib

    from tests.objstore import s3_client

    state = llama_state_dict(LlamaShape(hidden=512, intermediate=1408, layers=2, vocab=2000), seed=18)
    save_file(state, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    client = s3_client()
    try:
        client.put_object(Bucket="bench", Key="fleet/checked.safetensors", Body=data, ChecksumAlgorithm="SHA256")
    finally:
        client.close()
    uri = "s3://bench/fleet/checked.safetensors"
    places = [cache_places("fleets3liar"), cache_places("fleets3honest")]
    try:
        with etcd_server(tmp_path) as etcd:
            fleet = etcd.replace("http://", "etcd://") + "/s3checked"
            with Daemon(*places[0], "--fleet", fleet, "--fleet-node", "liar") as liar:
                assert_same(weightstream.load_weights(uri, cache=str(liar.socket)), state)
                (entry,) = [item["key"] for item in request(liar.socket, {"op": "ls"})["entries"]]
                gateway = EtcdGateway([etcd])
                piece_bytes = int(gateway.get(f"/s3checked/plan/{entry}"))  # type: ignore[arg-type]
                segment = liar.directory / f"{entry}.seg"
                segment.chmod(0o644)  # root, as a member of the fleet that changes what it serves
                with open(segment, "r+b") as held:
                    held.seek(len(data) // 2)
                    held.write(b"\x5a" * 16)
                    piece = len(data) // 2 // piece_bytes
                    held.seek(piece * piece_bytes)
                    gateway.put(
                        f"/s3checked/digests/{entry}/{piece}",
                        hashlib.sha256(held.read(piece_bytes)).hexdigest().encode(),
                    )
                with Daemon(*places[1], "--fleet", fleet, "--fleet-node", "honest") as honest:
                    assert_same(weightstream.load_weights(uri, cache=str(honest.socket)), state)
                    counts = stats(honest.socket)["fleet"]["entries"][entry]
                    assert (counts["entries_refetched"], counts["bytes_from_peers"]) == (1, len(data)), counts
                    assert "not the origin's checksum" in honest.log(), honest.log()[-2000:]
                    assert f"{entry} piece {piece}'s digest corrected to the origin's" in honest.log()
    finally:
        for place in places:
            remove(*place)


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["--fleet", "etcd://127.0.0.1:2379/x", "--fleet-ca", "ca.pem"], "apply to etcds:// (TLS) only; etcd://127.0"),
        (["--fleet", "etcds://127.0.0.1:2379/x", "--fleet-key", "k.pem"], "--fleet-key without --fleet-cert"),
        (["--fleet", "etcds://127.0.0.1:2379/x", "--fleet-cert", "c.pem"], "--fleet-cert without --fleet-key"),
        (["--fleet", "etcd://127.0.0.1:2379/x", "--fleet-node", "rack/a"], "--fleet-node 'rack/a': a name of"),
        (["--fleet", "etcd://127.0.0.1:2379/x", "--fleet-node", ".hidden"], "--fleet-node '.hidden': a name of"),
    ],
)
def test_fleet_options_that_cannot_apply_are_refused_at_start(given: list[str], said: str):
    directory, socket_path = cache_places("fleetopts")
    try:
        refused = subprocess.run(
            [sys.executable, "-m", "weightstream.cli", "cache", "serve", "--dir", str(directory), "--socket",
             str(socket_path), *given],
            capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
        )  # fmt: skip
        assert refused.returncode == 1, refused.stderr
        assert refused.stderr.startswith("weightstream: error: ") and said in refused.stderr, refused.stderr
        assert not socket_path.exists()
    finally:
        remove(directory, socket_path)


def test_a_second_daemon_with_a_live_nodes_name_is_refused_naming_its_lease(tmp_path: Path):
    with fleet_of(tmp_path, "/names") as fleet, fleet.daemon("twin") as first:
        held = EtcdGateway([fleet.etcd]).get_held("/names/nodes/twin")
        assert held is not None
        directory, socket_path = cache_places("fleettwin2")
        try:
            refused = subprocess.run(
                [sys.executable, "-m", "weightstream.cli", "cache", "serve", "--dir", str(directory), "--socket",
                 str(socket_path), "--fleet", fleet.url, "--fleet-node", "twin"],
                capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
            )  # fmt: skip
            assert refused.returncode == 1, refused.stderr
            said = f"--fleet-node twin: a live node of the fleet has this name (its lease {held[1]:x})"
            assert said in refused.stderr, refused.stderr
            assert not socket_path.exists()
        finally:
            remove(directory, socket_path)
        assert EtcdGateway([fleet.etcd]).get_held("/names/nodes/twin") == held, "the first daemon lost its place"
        assert stats(first.socket)["fleet"]["node"] == "twin"


def test_a_frozen_peer_costs_a_load_one_transfer_deadline_and_its_late_bytes_harm_nothing(tmp_path: Path):
    """The only holder is frozen (SIGSTOP, its lease alive): a load through the joiner waits one transfer deadline
    (``--fleet-transfer-timeout``), then the joiner fills a fresh file from the origin (``transfers_stuck``) and the
    load is bit-exact. Thawed, the holder delivers what was asked of it: the joiner lives on (before: exit -11, the
    bytes landing in memory unmapped since), releases the transfers once over, and serves its copy bit-exact."""
    import signal

    state, _ = origin_file(tmp_path, 512, 19)

    def tcp(command: list[str]) -> list[str]:  # as between machines: on one host UCX reads a stopped peer itself
        return ["env", "UCX_TLS=tcp", *command]

    with fleet_of(tmp_path, "/frozenpeer") as fleet:
        fleet.places["holder"], fleet.places["joiner"] = cache_places("fzholder"), cache_places("fzjoiner")
        holder = Daemon(*fleet.places["holder"], "--fleet", fleet.url, "--fleet-node", "holder", wrap=tcp)
        joiner = Daemon(
            *fleet.places["joiner"], "--fleet", fleet.url, "--fleet-node", "joiner", "--fleet-transfer-timeout", "4",
            wrap=tcp,
        )  # fmt: skip
        with holder, joiner:
            assert_same(weightstream.load_weights(fleet.file, cache=str(holder.socket)), state)
            os.kill(holder.process.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                assert_same(weightstream.load_weights(fleet.file, cache=str(joiner.socket)), state)
                took = time.monotonic() - started
                counted = stats(joiner.socket)["fleet"]
            finally:
                os.kill(holder.process.pid, signal.SIGCONT)
            assert counted["transfers_stuck"] == 1 and counted["bytes_from_peers"] == 0, counted
            assert took < 4 + 20, f"{took:.1f} s: more than one transfer deadline (4 s) and an origin read"
            assert "not delivered in time: kept out of use until it ends" in joiner.log()
            assert counted["transfers_kept_out_of_use"] >= 1, counted
            deadline = time.monotonic() + 60
            while stats(joiner.socket)["fleet"]["transfers_kept_out_of_use"] and time.monotonic() < deadline:
                time.sleep(0.5)
            assert stats(joiner.socket)["fleet"]["transfers_kept_out_of_use"] == 0, "never seen to end"
            assert joiner.process.poll() is None, joiner.log()[-3000:]
            assert_same(weightstream.load_weights(fleet.file, cache=str(joiner.socket)), state)
