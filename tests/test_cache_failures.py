"""The node cache when things go wrong: a fill that fails, evictions racing attaches, slow clients, shutdown in the
middle of a fill, clients that vary their options, start-up options that make no sense, a prefetch that cannot fit.
Each against a real daemon process."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weightstream
from tests.cache_daemon import ROOT, Daemon, remove, request
from tests.cache_daemon import places as cache_places
from tests.rangeserver import RangeServer
from weightstream.errors import AccessDeniedError
from weightstream.nodecache.protocol import LENGTH

pytestmark = pytest.mark.slow


@pytest.fixture
def places():
    directory, sock = cache_places("fail")
    yield directory, sock
    remove(directory, sock)


def shared_memory_of(pid: int, directory: Path) -> list[str]:
    """The mappings and descriptors process ``pid`` holds in ``directory`` (deleted files included)."""
    inside = f"{directory}/"
    held = [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if inside in line]
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith(inside) and not target.endswith(".weightstream-cache"):
            held.append(target)
    return held


def test_a_failing_fill_gives_every_client_the_sources_error_once_and_frees_its_memory(tmp_path, places):
    weights = {"w": torch.arange(6 << 20, dtype=torch.int32)}  # 24 MiB: three fill chunks
    save_file(weights, str(tmp_path / "model.safetensors"))
    with RangeServer(tmp_path) as server, Daemon(*places) as daemon:
        uri = server.url + "/model.safetensors"
        server.misbehave.forbid_from = 8 << 20  # credentials revoked past 8 MiB
        server.misbehave.delay_s = 1.0  # every client is waiting for the one fill when it fails
        errors: list[BaseException] = []

        def load() -> None:
            try:
                weightstream.load_weights(uri, cache=str(daemon.socket))
            except Exception as error:  # noqa: BLE001  # each client's error, whatever it is, is the result
                errors.append(error)

        threads = [threading.Thread(target=load) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert len(errors) == 3 and all(isinstance(error, AccessDeniedError) for error in errors), errors
        assert len({str(error) for error in errors}) == 1
        assert re.search(r"model\.safetensors.*: access denied \(HTTP 403", str(errors[0])), errors[0]
        assert str(errors[0]).endswith(
            f"(read by the cache daemon at {daemon.socket}, with the daemon's own environment and credentials unless "
            "storage_options sent this process's)"
        ), errors[0]
        ranges = [line for line in server.requests if line.startswith("GET") and "bytes=" in line]
        first_bytes = [int(re.search(r"bytes=(\d+)-", line)[1]) for line in ranges]
        fill_ranges = [start for start in first_bytes if start % (8 << 20) == 0 and start > 0]
        assert len(fill_ranges) == len(set(fill_ranges)), f"the fill ran more than once: {ranges}"
        assert shared_memory_of(daemon.process.pid, daemon.directory) == []
        assert not [path.name for path in daemon.directory.iterdir() if path.name.startswith("tmp-")]
        stats = request(daemon.socket, {"op": "stats"})
        assert (stats["fills"], stats["entries"], stats["filling"]) == (0, 0, 0) and stats["fill_errors"] >= 1
        server.misbehave.forbid_from = None
        assert torch.equal(weightstream.load_weights(uri, cache=str(daemon.socket))["w"], weights["w"])
    assert "Traceback" not in daemon.log() and "connection failed" not in daemon.log()


def test_evictions_racing_attaches_drop_no_client(tmp_path, places):
    for index in range(4):
        save_file({"w": torch.full((64 << 10,), index, dtype=torch.int32)}, str(tmp_path / f"m{index}.safetensors"))
    failures: list[BaseException] = []
    evicted: list[str] = []
    stop = threading.Event()
    with Daemon(*places) as daemon:

        def attach(index: int) -> None:
            while not stop.is_set():
                try:
                    loaded = weightstream.load_weights(
                        tmp_path / f"m{index}.safetensors", cache=str(daemon.socket), zero_copy=False
                    )
                    assert int(loaded["w"][0]) == index
                except Exception as error:  # noqa: BLE001  # any failure of any client fails the test
                    failures.append(error)
                    return
                stop.wait(0.01)  # between loads the entry is unreferenced: evictable (on a loaded machine too)

        def evict() -> None:
            while not stop.is_set():
                evicted.extend(request(daemon.socket, {"op": "evict", "all": True})["evicted"])

        threads = [threading.Thread(target=attach, args=(index,)) for index in range(4)]
        threads.append(threading.Thread(target=evict))
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while len(evicted) < 8 and not failures and time.monotonic() < deadline:
            time.sleep(0.1)
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        stats = request(daemon.socket, {"op": "stats"})
    assert failures == []
    assert len(evicted) >= 8 and stats["fills"] > 4, f"too few evictions raced the attaches: {len(evicted)}"
    assert "Traceback" not in daemon.log() and "connection failed" not in daemon.log()


def test_trickling_clients_are_dropped_and_sigterm_stops_the_daemon_at_once(tmp_path, places):
    save_file({"w": torch.ones(1024)}, str(tmp_path / "model.safetensors"))
    daemon = Daemon(*places, "--idle-timeout", "2").start()
    trickling = []
    try:
        for _ in range(64):
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.connect(str(daemon.socket))
            connection.sendall(LENGTH.pack(200))
            trickling.append(connection)

        def trickle() -> None:
            for _ in range(20):
                for connection in trickling:
                    try:
                        connection.sendall(b" ")
                    except OSError:
                        pass
                time.sleep(0.5)

        feeder = threading.Thread(target=trickle)
        feeder.start()
        time.sleep(3)  # every trickling request is past its whole-request bound by now
        started = time.monotonic()
        loaded = weightstream.load_weights(tmp_path / "model.safetensors", cache=str(daemon.socket))
        assert torch.equal(loaded["w"], torch.ones(1024)) and time.monotonic() - started < 5
        feeder.join()
        for connection in trickling:
            connection.close()
        trickling = []
        for _ in range(8):  # slow clients again, mid-request, as SIGTERM comes
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.connect(str(daemon.socket))
            connection.sendall(LENGTH.pack(200) + b" ")
            trickling.append(connection)
        started = time.monotonic()
        assert daemon.stop() == 0
        assert time.monotonic() - started < 5
    finally:
        for connection in trickling:
            connection.close()


def test_sigterm_during_a_fill_tells_its_client_and_leaves_no_temporary_file(tmp_path, places):
    save_file({"w": torch.arange(64 << 10, dtype=torch.int32)}, str(tmp_path / "model.safetensors"))
    with RangeServer(tmp_path) as server:
        server.misbehave.trickle_seconds_per_byte = 0.0002  # the fill takes about a minute
        daemon = Daemon(*places, "--stop-timeout", "1").start()
        loader = loading_mid_fill(server.url + "/model.safetensors", daemon)
        started = time.monotonic()
        assert daemon.stop() == 0
        stopped = time.monotonic() - started
        said, _ = loader.communicate(timeout=60)
    assert stopped < 20, f"SIGTERM took {stopped:.1f} s"
    assert json.loads(said) == {
        "error": "CacheUnavailableError",
        "message": f"{server.url}/model.safetensors: the cache daemon is stopping; its fill was cancelled",
    }
    assert sorted(path.name for path in daemon.directory.iterdir()) == [".weightstream-cache"]


LOAD_AND_SAY = """
import json, sys, weightstream
try:
    weightstream.load_weights(sys.argv[1], cache=sys.argv[2])
    print(json.dumps({"loaded": True}))
except Exception as error:
    print(json.dumps({"error": type(error).__name__, "message": str(error)}))
"""


def loading_mid_fill(uri: str, daemon: Daemon) -> subprocess.Popen:
    """A process loading ``uri`` through ``daemon`` (it prints what it got as JSON), once the daemon's fill for it has
    started."""
    loader = subprocess.Popen(
        [sys.executable, "-c", LOAD_AND_SAY, uri, str(daemon.socket)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not any(path.name.startswith("tmp-") for path in daemon.directory.iterdir()):
        assert time.monotonic() < deadline, "no fill started"
        time.sleep(0.05)
    return loader


def cli(*args: str) -> subprocess.CompletedProcess:
    """``weightstream ARGS`` run to its end."""
    command = [sys.executable, "-m", "weightstream.cli", *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_clients_varying_their_options_do_not_exhaust_the_daemon(tmp_path, places):
    save_file({"w": torch.ones(256)}, str(tmp_path / "model.safetensors"))
    with RangeServer(tmp_path) as server, Daemon(*places) as daemon:
        before = len(os.listdir(f"/proc/{daemon.process.pid}/fd"))
        for index in range(60):
            loaded = weightstream.load_weights(
                server.url + "/model.safetensors",
                cache=str(daemon.socket),
                storage_options={"headers": {"X-Client": str(index)}},
                zero_copy=False,
            )
            assert torch.equal(loaded["w"], torch.ones(256))
        stats = request(daemon.socket, {"op": "stats"})
        after = len(os.listdir(f"/proc/{daemon.process.pid}/fd"))
    assert stats["stores"] <= 16
    assert after - before < 40, f"the daemon's descriptors grew from {before} to {after}"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--budget", "9" * 400], "argument --budget: not a size"),
        (["--budget", "99999999999999999999"], "argument --budget: too large a size"),
        (["--group", "no-such-group-here"], "weightstream: error: --group no-such-group-here: no such group"),
        (["--group", "99999999999"], "weightstream: error: --group 99999999999: a group id is below 4294967295"),
        (["--fleet-transfer-timeout", "5"], "--fleet-transfer-timeout need --fleet"),
        (["--device", "nonsense"], "weightstream: error: --device 'nonsense': name a GPU as cuda:N"),
        (["--idle-timeout", "nan"], "argument --idle-timeout: seconds must be positive and finite, got 'nan'"),
        (["--idle-timeout", "-1"], "argument --idle-timeout: seconds must be positive and finite, got '-1'"),
        (["--idle-timeout", "inf"], "argument --idle-timeout: seconds must be positive and finite, got 'inf'"),
        (["--idle-timeout", "0"], "argument --idle-timeout: seconds must be positive and finite, got '0'"),
    ],
)
def test_nonsense_options_are_refused_in_one_line_before_anything_starts(places, options, message):
    directory, sock = places
    result = cli("cache", "serve", "--dir", str(directory), "--socket", str(sock), *options)
    assert result.returncode in (1, 2) and "Traceback" not in result.stderr
    assert message in result.stderr.strip().splitlines()[-1]
    assert not sock.exists()


def test_a_file_as_the_directory_is_refused_in_one_line(tmp_path, places):
    _, sock = places
    (tmp_path / "file").write_text("x")
    result = cli("cache", "serve", "--dir", str(tmp_path / "file"), "--socket", str(sock))
    assert (result.returncode, result.stderr) == (
        1,
        f"weightstream: error: --dir {tmp_path / 'file'}: is not a directory\n",
    )


def test_a_budget_beyond_the_machine_is_clamped_with_a_warning(places):
    with Daemon(*places, "--budget", "1000Ti") as daemon:
        budget = daemon.status["budget"]
    assert budget < 1000 << 40
    assert "--budget 1099511627776000 is more than" in daemon.log() and "clamped to it" in daemon.log()


def test_a_prefetch_that_cannot_hold_the_checkpoint_fails_and_changes_nothing(tmp_path, places):
    from tests.conftest import save_hf_sharded

    save_file({"w": torch.zeros(100 << 10, dtype=torch.uint8)}, str(tmp_path / "other.safetensors"))
    tensors = {f"layer.{i}": torch.zeros(150 << 10, dtype=torch.uint8) + i for i in range(4)}
    checkpoint = save_hf_sharded(tensors, tmp_path / "ckpt", shards=2)
    with Daemon(*places, "--budget", str(400 << 10)) as daemon:
        weightstream.load_weights(tmp_path / "other.safetensors", cache=str(daemon.socket), zero_copy=False)
        before = request(daemon.socket, {"op": "ls"})["entries"]
        result = cli("cache", "prefetch", str(checkpoint), "--socket", str(daemon.socket))
        assert result.returncode == 1
        assert re.fullmatch(
            rf"weightstream: error: {checkpoint}: \d+ bytes do not fit the cache: the budget is 409600 bytes and 0 "
            r"are held\n",
            result.stderr,
        ), result.stderr
        assert request(daemon.socket, {"op": "ls"})["entries"] == before
        assert request(daemon.socket, {"op": "stats"})["fills"] == 1


NO_NUMPY = """
import sys
class NoNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError("No module named 'numpy'", name="numpy")
sys.meta_path.insert(0, NoNumpy())
import torch, weightstream
loaded = weightstream.load_weights(sys.argv[1], cache=sys.argv[2])
assert "numpy" not in sys.modules
print(sorted(loaded), float(loaded["w"].sum()))
"""


def test_the_cache_round_trip_needs_no_numpy(tmp_path, places):
    save_file({"w": torch.ones(1000)}, str(tmp_path / "model.safetensors"))
    with Daemon(*places) as daemon:
        for _ in range(2):  # the fill, then the attach of the filled entry
            result = subprocess.run(
                [sys.executable, "-c", NO_NUMPY, str(tmp_path / "model.safetensors"), str(daemon.socket)],
                check=False,
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=120,
            )
            assert result.returncode == 0, result.stderr[-2000:]
            assert result.stdout.strip() == "['w'] 1000.0"


def test_a_daemon_gone_mid_request_is_not_asked_twice(tmp_path, places):
    save_file({"w": torch.arange(64 << 10, dtype=torch.int32)}, str(tmp_path / "model.safetensors"))
    with RangeServer(tmp_path) as server:
        server.misbehave.trickle_seconds_per_byte = 0.0005
        daemon = Daemon(*places).start()
        loader = loading_mid_fill(server.url + "/model.safetensors", daemon)
        daemon.kill()
        restarted = Daemon(*places).start()
        try:
            said, _ = loader.communicate(timeout=60)
            assert json.loads(said)["error"] == "CacheUnavailableError"
            assert request(restarted.socket, {"op": "stats"})["attaches"] == 0  # the request was not sent again
        finally:
            restarted.stop()
