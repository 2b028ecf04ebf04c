"""The node weight cache against a real daemon process: attach, views of shared memory, one fill for many
clients, staleness, restarts, kill -9, permissions, hostile clients, budget."""

from __future__ import annotations

import gc
import json
import os
import re
import secrets
import socket
import stat
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
from tests.conftest import assert_same, save_hf_sharded
from weightstream.errors import (
    CacheFullError,
    CacheProtocolError,
    CacheUnavailableError,
)
from weightstream.nodecache.daemon.limits import tmpfs_huge_pages
from weightstream.nodecache.protocol import LENGTH, MAX_REQUEST_BYTES, receive


@pytest.fixture
def places():
    """A segment directory and a socket path of this test's, removed after."""
    directory, sock = cache_places("test")
    yield directory, sock
    remove(directory, sock)


@pytest.fixture
def daemon(places):
    with Daemon(*places) as running:
        yield running


def state(seed: int = 0, layers: int = 4) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 96, generator=generator) for i in range(layers)}
    tensors["model.embed_tokens.weight"] = torch.randn(100, 64, generator=generator).to(torch.bfloat16)
    return tensors


def segment_mappings(directory: Path) -> int:
    return sum(str(directory) in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_a_cached_load_is_the_checkpoint_as_views_of_shared_memory(tmp_path, daemon, no_leaks):
    tensors = state()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    first = weightstream.load_weights(tmp_path / "model.safetensors", cache=str(daemon.socket))
    assert_same(first, tensors)
    assert segment_mappings(daemon.directory) >= 1, "the tensors are not views of a cache segment"
    second = weightstream.load_weights(tmp_path / "model.safetensors", cache=str(daemon.socket))
    assert_same(second, tensors)
    stats = request(daemon.socket, {"op": "stats"})
    assert (stats["fills"], stats["bytes_filled"]) == (1, (tmp_path / "model.safetensors").stat().st_size)
    assert stats["hits"] >= 1 and stats["referencing_processes"] == 1


def test_a_cold_file_is_filled_around_the_page_cache(tmp_path, daemon, no_leaks):
    from weightstream.sources.local.pagecache import drop, resident_fraction

    tensors = {"w": torch.randn(3 << 20)}  # 12 MiB and 8 bytes of header: its end is not block-aligned
    save_file(tensors, str(tmp_path / "model.safetensors"))
    drop(str(tmp_path / "model.safetensors"))
    loaded = weightstream.load_weights(tmp_path / "model.safetensors", cache=str(daemon.socket))
    assert torch.equal(loaded["w"], tensors["w"])
    assert resident_fraction(str(tmp_path / "model.safetensors")) < 0.1, "the fill read it through the page cache"
    segment = next(daemon.directory.glob("*.seg"))
    assert segment.stat().st_size == (tmp_path / "model.safetensors").stat().st_size


def test_writing_a_view_never_reaches_the_shared_bytes(tmp_path, daemon, no_leaks):
    tensors = state()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    loaded = weightstream.load_weights(tmp_path / "model.safetensors", cache=str(daemon.socket))
    loaded[name].add_(1)
    again = weightstream.load_weights(tmp_path / "model.safetensors", cache=str(daemon.socket))
    assert torch.equal(again[name], tensors[name])
    segment = next(daemon.directory.glob("*.seg"))
    assert stat.S_IMODE(segment.stat().st_mode) == 0o444
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("format", "options"),
    [
        ("safetensors", {}),
        ("safetensors", {"zero_copy": False}),
        ("streaming", {"max_inflight_bytes": 64 << 10, "chunk_bytes": 16 << 10}),
        ("layered", {}),
    ],
)
def test_every_loader_reads_through_the_cache(tmp_path, daemon, format, options, no_leaks):
    tensors = state(layers=6)
    directory = save_hf_sharded(tensors, tmp_path / "ckpt", shards=3)
    loaded = weightstream.load_weights(directory, format=format, cache=str(daemon.socket), **options)
    assert_same(loaded, tensors)
    assert request(daemon.socket, {"op": "stats"})["entries"] == 4  # three shards and the index


def test_each_rank_reads_its_own_sharded_state_files_through_the_cache(tmp_path, daemon, no_leaks):
    from tests.test_sharded_state import save_world

    states = save_world(tmp_path / "state", 2, max_file_bytes=256 << 10)
    for rank, expected in enumerate(states):
        loaded = weightstream.load_weights(
            tmp_path / "state", format="sharded-state", rank=rank, world_size=2, verify=True, cache=str(daemon.socket)
        )
        assert_same(loaded, expected)
    uris = {Path(entry["uri"]).name for entry in request(daemon.socket, {"op": "ls"})["entries"]}
    assert any("rank-0" in name for name in uris) and any("rank-1" in name for name in uris)


def test_owned_memory_when_asked(tmp_path, daemon, no_leaks):
    save_file(state(), str(tmp_path / "model.safetensors"))
    before = segment_mappings(daemon.directory)
    with weightstream.open(tmp_path / "model.safetensors", cache=str(daemon.socket), zero_copy=False) as checkpoint:
        owned = checkpoint.load()
    gc.collect()
    assert segment_mappings(daemon.directory) == before
    assert owned["model.layers.0.mlp.up_proj.weight"].is_contiguous()


def test_a_rewritten_source_is_a_new_entry_and_the_old_one_is_never_served(tmp_path, daemon, no_leaks):
    path = tmp_path / "model.safetensors"
    save_file(state(seed=1), str(path))
    assert_same(weightstream.load_weights(path, cache=str(daemon.socket)), state(seed=1))
    time.sleep(0.01)
    save_file(state(seed=2), str(path))  # same names and shapes, other bytes: only the version tells
    assert_same(weightstream.load_weights(path, cache=str(daemon.socket)), state(seed=2))
    entries = request(daemon.socket, {"op": "ls"})["entries"]
    assert len(entries) == 2 and len({entry["version"] for entry in entries}) == 2


def test_a_replaced_object_is_a_new_entry_and_the_old_one_is_never_served(s3_endpoint, tmp_path, places, no_leaks):
    from tests.test_objectstore import upload

    for name, seed in (("one", 3), ("two", 4)):
        (tmp_path / name).mkdir()
        save_file(state(seed=seed), str(tmp_path / name / "model.safetensors"))
    key = f"cache-replaced-{secrets.token_hex(3)}"
    with Daemon(*places) as running:  # started after the S3 server: it reads S3 with the same variables
        uri = upload("s3", tmp_path / "one", key)
        assert_same(weightstream.load_weights(uri, cache=str(running.socket)), state(seed=3))
        upload("s3", tmp_path / "two", key)  # the same key, other bytes: another ETag
        assert_same(weightstream.load_weights(uri, cache=str(running.socket)), state(seed=4))
        entries = request(running.socket, {"op": "ls"})["entries"]
    assert len(entries) == 2 and len({entry["version"] for entry in entries}) == 2


def test_two_clients_filling_one_entry_read_the_source_once(tmp_path, daemon, no_leaks):
    tensors = {"w": torch.randn(4 << 20)}  # 16 MiB: the fills overlap
    save_file(tensors, str(tmp_path / "model.safetensors"))
    results: list = []

    def load() -> None:
        results.append(weightstream.load_weights(tmp_path / "model.safetensors", cache=str(daemon.socket)))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(torch.equal(result["w"], tensors["w"]) for result in results)
    assert request(daemon.socket, {"op": "stats"})["fills"] == 1


def test_a_restarted_daemon_adopts_complete_entries_without_reading_again(tmp_path, places, no_leaks):
    save_file(state(), str(tmp_path / "model.safetensors"))
    with Daemon(*places) as first:
        weightstream.load_weights(tmp_path / "model.safetensors", cache=str(first.socket))
    assert first.process.returncode == 0  # SIGTERM drains and exits cleanly
    with Daemon(*places) as second:
        assert second.status["adopted"] == 1
        assert_same(weightstream.load_weights(tmp_path / "model.safetensors", cache=str(second.socket)), state())
        assert request(second.socket, {"op": "stats"})["fills"] == 0


def test_tensors_stay_valid_after_the_daemon_is_killed(tmp_path, places, no_leaks):
    save_file(state(), str(tmp_path / "model.safetensors"))
    running = Daemon(*places).start()
    loaded = weightstream.load_weights(tmp_path / "model.safetensors", cache=str(running.socket))
    running.kill()
    assert_same(loaded, state())


def test_kill_9_mid_fill_leaves_nothing_a_client_can_map(tmp_path, places, no_leaks):
    from tests.rangeserver import RangeServer

    save_file({"w": torch.arange(64 << 10, dtype=torch.int32)}, str(tmp_path / "model.safetensors"))
    directory, _ = places
    with RangeServer(tmp_path) as server:
        server.misbehave.trickle_seconds_per_byte = 0.0005  # a 256 KiB fill takes minutes
        running = Daemon(*places).start()
        loader = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys, weightstream; weightstream.load_weights(sys.argv[1], cache=sys.argv[2])",
                server.url + "/model.safetensors",
                str(running.socket),
            ],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while not any(path.name.startswith("tmp-") for path in directory.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(path.name.startswith("tmp-") for path in directory.iterdir()), "no fill started"
        running.kill()
        loader.wait(timeout=30)
        assert loader.returncode != 0 and "CacheUnavailableError" in loader.stderr.read()
        loader.stderr.close()
        server.misbehave.trickle_seconds_per_byte = 0
        with Daemon(*places) as restarted:
            assert (restarted.status["adopted"], restarted.status["discarded"]) == (0, 1)
            assert not any(path.name.startswith("tmp-") for path in directory.iterdir())
            loaded = weightstream.load_weights(server.url + "/model.safetensors", cache=str(restarted.socket))
    assert torch.equal(loaded["w"], torch.arange(64 << 10, dtype=torch.int32))


def ended_by_peer(connection: socket.socket) -> bool:
    """The daemon closed the connection (a reset when it left unread bytes behind)."""
    try:
        return connection.recv(1) == b""
    except ConnectionResetError:
        return True


def raw(sock: Path) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(10)
    connection.connect(str(sock))
    return connection


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (LENGTH.pack(2**31) + b"{", r"a message of 2147483648 bytes; at most 65536 are accepted"),
        (LENGTH.pack(5) + b"nope!", r"not a JSON message"),
        (LENGTH.pack(2) + b"[]", r"a message must be a JSON object, got list"),
        (LENGTH.pack(15) + b'{"op": "rm -r"}', r"unknown operation 'rm -r'"),
        (LENGTH.pack(26) + b'{"op": "attach", "uri": 1}', r"attach request: 'uri' must be str, got int"),
    ],
)
def test_malformed_requests_get_an_error_and_the_daemon_carries_on(daemon, payload, message, no_leaks):
    with raw(daemon.socket) as connection:
        connection.sendall(payload)
        answer, fds = receive(connection, 1 << 20, "test")
        assert fds == [] and answer["ok"] is False and answer["error"] == "CacheProtocolError"
        assert re.search(message, answer["message"])
        assert ended_by_peer(connection)
    assert request(daemon.socket, {"op": "stats"})["bad_requests"] == 1


def test_a_truncated_message_and_a_silent_client_cost_the_daemon_nothing(places, no_leaks):
    with (
        Daemon(*places, "--idle-timeout", "1") as running,
        raw(running.socket) as silent,
        raw(running.socket) as truncated,
    ):
        truncated.sendall(LENGTH.pack(100) + b'{"op"')
        started = time.monotonic()
        assert request(running.socket, {"op": "stats"})["entries"] == 0  # served meanwhile
        assert ended_by_peer(silent) and ended_by_peer(truncated)  # both dropped after the idle timeout
        assert time.monotonic() - started < 5


def test_a_request_over_the_bound_is_never_read(daemon, no_leaks):
    with raw(daemon.socket) as connection:
        body = json.dumps({"op": "attach", "uri": "x" * MAX_REQUEST_BYTES}).encode()
        connection.sendall(LENGTH.pack(len(body)))
        answer, _ = receive(connection, 1 << 20, "test")
        assert answer["error"] == "CacheProtocolError" and "at most 65536" in answer["message"]


def test_a_fill_over_the_budget_is_refused_before_any_read_and_lru_makes_room(tmp_path, places, no_leaks):
    for index in range(3):
        save_file({"w": torch.zeros(150 << 10, dtype=torch.uint8) + index}, str(tmp_path / f"m{index}.safetensors"))
    save_file({"w": torch.zeros(2 << 20, dtype=torch.uint8)}, str(tmp_path / "big.safetensors"))
    with Daemon(*places, "--budget", str(400 << 10)) as running:
        with pytest.raises(
            CacheFullError, match=r"big.safetensors: \d+ bytes do not fit the cache: the budget is 409600 bytes"
        ):
            weightstream.load_weights(tmp_path / "big.safetensors", cache=str(running.socket))
        for index in range(3):
            assert (
                weightstream.load_weights(
                    tmp_path / f"m{index}.safetensors", cache=str(running.socket), zero_copy=False
                )["w"][0]
                == index
            )
        entries = request(running.socket, {"op": "ls"})["entries"]
        assert sorted(Path(entry["uri"]).name for entry in entries) == ["m1.safetensors", "m2.safetensors"]
        assert request(running.socket, {"op": "stats"})["fills"] == 3


def test_referenced_entries_are_kept_by_evict(tmp_path, daemon, no_leaks):
    save_file(state(), str(tmp_path / "model.safetensors"))
    held = weightstream.load_weights(tmp_path / "model.safetensors", cache=str(daemon.socket))
    answer = request(daemon.socket, {"op": "evict", "all": True})
    assert answer["evicted"] == [] and len(answer["kept_referenced"]) == 1
    del held
    gc.collect()
    assert len(request(daemon.socket, {"op": "evict", "all": True})["evicted"]) == 1


def test_auto_without_a_daemon_reads_the_source_and_an_explicit_socket_raises(tmp_path, monkeypatch, caplog, no_leaks):
    save_file(state(), str(tmp_path / "model.safetensors"))
    monkeypatch.setenv("WEIGHTSTREAM_CACHE", str(tmp_path / "nobody.sock"))
    with caplog.at_level("DEBUG", logger="weightstream.nodecache.connection"):
        assert_same(weightstream.load_weights(tmp_path / "model.safetensors", cache="auto"), state())
    assert [(record.levelname, record.getMessage()) for record in caplog.records] == [
        (
            "INFO",  # someone configured that socket: said where a user looking at info sees it
            f"cache='auto': no weightstream cache daemon at {tmp_path / 'nobody.sock'}: no such socket; reading from "
            + "the source",
        )
    ]
    caplog.clear()
    monkeypatch.delenv("WEIGHTSTREAM_CACHE")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the default socket, absent: a machine without a daemon
    from weightstream.nodecache.connection import ROOT_SOCKET

    if not os.path.lexists(ROOT_SOCKET):
        with caplog.at_level("DEBUG", logger="weightstream.nodecache.connection"):
            assert_same(weightstream.load_weights(tmp_path / "model.safetensors", cache="auto"), state())
        assert [record.levelname for record in caplog.records] == ["DEBUG"], caplog.records
        caplog.clear()
    stale = socket.socket(socket.AF_UNIX)  # a socket file nobody listens on: a daemon that died
    stale.bind(str(tmp_path / "stale.sock"))
    monkeypatch.setenv("WEIGHTSTREAM_CACHE", str(tmp_path / "stale.sock"))
    with caplog.at_level("WARNING", logger="weightstream.nodecache.connection"):
        for _ in range(2):
            assert_same(weightstream.load_weights(tmp_path / "model.safetensors", cache="auto"), state())
    stale.close()
    assert {record.levelname for record in caplog.records} == {"WARNING"}
    assert [record.getMessage() for record in caplog.records] == 2 * [
        f"cache='auto': no weightstream cache daemon at {tmp_path / 'stale.sock'}: Connection refused; reading from "
        + "the source"
    ]
    with pytest.raises(
        CacheUnavailableError, match=rf"no weightstream cache daemon at {tmp_path / 'nobody.sock'}: no such socket"
    ):
        weightstream.load_weights(tmp_path / "model.safetensors", cache=str(tmp_path / "nobody.sock"))


def test_a_segment_that_does_not_match_its_checksum_is_refused(tmp_path, daemon, no_leaks):
    save_file(state(), str(tmp_path / "model.safetensors"))
    weightstream.load_weights(tmp_path / "model.safetensors", cache=str(daemon.socket), zero_copy=False)
    segment = next(daemon.directory.glob("*.seg"))
    os.chmod(segment, 0o644)
    with open(segment, "r+b") as corrupt:  # what a hostile process of the same user could do
        corrupt.seek(9)
        corrupt.write(b"X")
    with pytest.raises(CacheProtocolError, match=r"does not match the checksum of its first bytes"):
        weightstream.load_weights(tmp_path / "model.safetensors", cache=str(daemon.socket))


@pytest.mark.skipif(tmpfs_huge_pages("/dev/shm") != "never", reason="/dev/shm gives huge pages here")
def test_huge_pages_on_a_filesystem_without_them_is_refused_at_start(places):
    directory, sock = places
    result = subprocess.run(
        [sys.executable, "-m", "weightstream.cli", "cache", "serve", "--dir", str(directory), "--socket", str(sock)]
        + ["--huge-pages", "on"],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 1
    assert "huge pages asked for, but its filesystem gives none (tmpfs huge=never)" in result.stderr
    assert not sock.exists()


def cache_cli(daemon: Daemon, *args: str, json_output: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "weightstream.cli", "cache", *args, "--socket", str(daemon.socket)]
    return subprocess.run(
        command + (["--json"] if json_output else []),
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_cli_prefetch_ls_stats_evict_stop(tmp_path, daemon):
    save_file(state(), str(tmp_path / "model.safetensors"))

    def cli(*args: str) -> dict:
        result = cache_cli(daemon, *args)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    prefetched = cli("prefetch", str(tmp_path / "model.safetensors"))
    assert prefetched["files"] == 1 and len(prefetched["keys"]) == 1
    assert cli("ls")["entries"][0]["key"] == prefetched["keys"][0]
    stats = cli("stats")
    assert stats["fills"] == 1
    assert stats["huge_pages"] is (tmpfs_huge_pages(str(daemon.directory)) in ("always", "within_size", "advise"))
    refused = cache_cli(daemon, "evict")
    assert refused.returncode == 1 and refused.stderr == (
        "weightstream: error: evict: name a KEY or a URI, or pass --all for every entry no process uses\n"
    )
    assert cli("evict", "--all")["evicted"] == prefetched["keys"]
    cli("prefetch", str(tmp_path / "model.safetensors"))
    assert cli("evict", str(tmp_path))["evicted"] == prefetched["keys"]  # by URI: the directory holding it
    stopped = cli("stop", "--wait")
    assert stopped["stopping"] is True and stopped["stopped"] is True and not daemon.socket.exists()
    assert daemon.process.wait(timeout=30) == 0


def test_cli_ls_for_people(tmp_path, daemon):
    assert cache_cli(daemon, "ls", json_output=False).stdout == "the cache is empty\n"
    hostile = tmp_path / "model\x1b]0;owned\x07.safetensors"
    save_file(state(), str(hostile))
    weightstream.load_weights(hostile, cache=str(daemon.socket), zero_copy=False)
    listed = cache_cli(daemon, "ls", json_output=False).stdout.splitlines()
    assert re.fullmatch(r"KEY +GIB +REFS +URI", listed[0])
    assert re.fullmatch(r"[0-9a-f]{32}  0\.000     0  .*model\\x1b\]0;owned\\x07\.safetensors", listed[1]), listed
    assert "\x1b" not in "".join(listed)


def test_a_load_says_whether_it_went_through_the_cache(tmp_path, daemon):
    """``load --cache``: the summary line and ``--json`` say how many files the daemon held and how many it filled
    for the load; ``--cache auto`` with no daemon says it was not used, and why; the API's ``stats.cache`` too."""
    uri = str(save_hf_sharded(state(), tmp_path / "ckpt", shards=2))

    def load(*arguments: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "weightstream.cli", "load", uri, *arguments]
        environment = {**os.environ, **(env or {})}
        return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, env=environment)

    files = len(list(Path(uri).iterdir()))  # two shards and their index, each a segment
    first = load("--cache", str(daemon.socket))
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip().endswith(f"; through the node cache: 0 files found there, {files} filled"), first.stdout
    again = json.loads(load("--cache", str(daemon.socket), "--json").stdout)
    assert again["cache"] == {"used": True, "hit": files, "filled": 0}
    absent = load("--cache", "auto", "--json", env={"WEIGHTSTREAM_CACHE": str(tmp_path / "none.sock")})
    assert json.loads(absent.stdout)["cache"] == {
        "used": False,
        "why": f"no weightstream cache daemon at {tmp_path / 'none.sock'}: no such socket",
    }
    with weightstream.open(uri) as checkpoint:
        assert checkpoint.stats.cache == {}


def test_cli_stats_for_people(tmp_path, daemon):
    """``cache stats`` without ``--json``: sizes in GiB as ``ls`` gives them, words where JSON says null or false."""
    save_file(state(), str(tmp_path / "model.safetensors"))
    weightstream.load_weights(tmp_path / "model.safetensors", cache=str(daemon.socket), zero_copy=False)
    text = cache_cli(daemon, "stats", json_output=False).stdout
    lines = text.splitlines()
    assert "None" not in text and "{" not in text and "True" not in text and "False" not in text, text
    assert re.search(r"^bytes: \d+\.\d{3} GiB$", text, re.MULTILINE), text
    assert re.search(r"^budget: (\d+\.\d{3} GiB|as much as fits)$", text, re.MULTILINE), text
    assert "fleet: not in a fleet" in lines and "fills: 1" in lines and "entries: 1" in lines, lines
    assert re.search(r"^huge_pages: (yes|no)$", text, re.MULTILINE), text
    log = daemon.log()  # a service says where it serves and what it fills, at its default level (info)
    assert re.search(r"INFO: serving \S+ from \S+, budget .*: 0 segments adopted .*; not in a fleet", log), log
    assert re.search(r"INFO: filled [0-9a-f]{32} \(\S*model\.safetensors, \d+ bytes\) in ", log), log


def test_a_signed_urls_signature_is_kept_nowhere_and_a_re_signed_url_is_the_same_entry(tmp_path, daemon):
    from tests.rangeserver import RangeServer

    save_file(state(), str(tmp_path / "model.safetensors"))
    with RangeServer(tmp_path) as server:
        signed = f"{server.url}/model.safetensors?sv=2024-05-04&se=2026-12-06T05%3A00Z&sp=r&sig=SECRETSIGNATURE1"
        prefetched = cache_cli(daemon, "prefetch", signed, json_output=False)
        assert prefetched.returncode == 0, prefetched.stderr
        re_signed = signed.replace("SECRETSIGNATURE1", "SECRETSIGNATURE2").replace("05%3A00Z", "06%3A00Z")
        assert_same(weightstream.load_weights(re_signed, cache=str(daemon.socket)), state())
        said = [prefetched.stdout, prefetched.stderr]
        said += [cache_cli(daemon, "ls", json_output=json_output).stdout for json_output in (True, False)]
        said += [path.read_text() for path in daemon.directory.glob("*.json")]
        stats = request(daemon.socket, {"op": "stats"})
    # One fill; two hits: the prefetch opens the checkpoint through the cache as a load does, then the load.
    assert stats["fills"] == 1 and stats["hits"] == 2, stats
    assert not [text for text in said if "SECRETSIGNATURE" in text], said
    assert "sig=REDACTED" in said[2]
