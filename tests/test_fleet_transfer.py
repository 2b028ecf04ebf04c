"""Pieces between node caches over NIXL (UCX over TCP or shared memory on this machine), between real processes: read
bit for bit and checked against the claimer's sha256, a wrong digest discarded, a peer killed mid-storm a typed
error, a peer's published memory not writable by another, NIXL's absence a typed error with the install hint."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="the fleet's data plane needs NIXL (pip install 'weightstream[fleet]')")

from weightstream.errors import CacheConfigError, FleetPeerError
from weightstream.nodecache.daemon.fleet import transfer
from weightstream.nodecache.daemon.fleet.records import parse_offer
from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


class Holder:
    """A ``tests.fleet_holder`` process serving ``path``."""

    def __init__(self, path: Path, node: str) -> None:
        self.info = path.with_suffix(".json")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fleet_holder", str(path), node, str(self.info)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while not self.info.exists():
            assert self.process.poll() is None, self.process.stderr.read()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the holder did not publish its segment"
            time.sleep(0.05)
        self.where = parse_offer(self.info.read_bytes())

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate(timeout=30)


@pytest.fixture
def segment(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(MIB) * 48 + os.urandom(16 * MIB)
    path = tmp_path / "segment"
    path.write_bytes(data)
    return path, data


@pytest.fixture
def destination():
    buffer = mmap.mmap(-1, 64 * MIB)
    yield buffer, ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    # the buffer's exported address lives as long as the mapping: closed by garbage collection


def test_pieces_read_from_a_peer_are_its_bytes_checked_against_their_digest(segment, destination):
    path, data = segment
    buffer, address = destination
    holder = Holder(path, "holder-a")
    try:
        fetcher = PieceFetcher("reader-a")
        piece = 16 * MIB
        for number in range(4):
            start = number * piece
            expected = hashlib.sha256(data[start : start + piece]).hexdigest()
            fetcher.read("holder-a", holder.where, start, piece, address + start, expected)
        assert bytes(buffer) == data
        with pytest.raises(FleetPeerError, match=r"^holder-a: bytes 0\.\.16777216 hash to [0-9a-f]{16}\.\.\., not the"):
            fetcher.read("holder-a", holder.where, 0, piece, address, "0" * 64)
        with pytest.raises(FleetPeerError, match=r"bytes 67108864\.\.67108865 lie outside its 67108864-byte offer"):
            fetcher.read("holder-a", holder.where, 64 * MIB, 1, address)
    finally:
        holder.kill()


def test_a_peer_killed_is_a_typed_error_not_a_wait(segment, destination):
    path, _ = segment
    _, address = destination
    holder = Holder(path, "holder-b")
    fetcher = PieceFetcher("reader-b", timeout_s=10)
    fetcher.read("holder-b", holder.where, 0, MIB, address)
    holder.kill()
    started = time.monotonic()
    with pytest.raises(
        FleetPeerError, match=r"^holder-b: (the read of bytes 0\.\.16777216 failed|bytes 0\.\.16777216 not)"
    ):
        fetcher.read("holder-b", holder.where, 0, 16 * MIB, address)
    assert time.monotonic() - started < 15


def test_a_peers_published_memory_is_not_writable_by_another(segment, destination):
    path, data = segment
    _, address = destination
    holder = Holder(path, "holder-c")
    try:
        api = transfer.nixl()
        agent = api.nixl_agent("writer-c", api.nixl_agent_config(backends=["UCX"]))
        agent.register_memory([(address, MIB, 0, "")], "DRAM")
        name = agent.add_remote_agent(bytes.fromhex(holder.where.metadata))
        written = "ERR"
        try:
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs([(address, MIB, 0)], "DRAM"),
                agent.get_xfer_descs([(holder.where.address, MIB, 0)], "DRAM"),
                name,
            )
            written = agent.transfer(handle)
            deadline = time.monotonic() + 10
            while written not in ("DONE", "ERR") and time.monotonic() < deadline:
                written = agent.check_xfer_state(handle)
        except Exception:  # noqa: BLE001 - NIXL raises for the refused write; its class varies by release
            written = "ERR"
        assert written != "DONE", "a peer wrote into another's published segment"
        assert holder.process.poll() is None, "the holder died of the attempt"
        assert path.read_bytes() == data
    finally:
        holder.kill()


def test_without_nixl_the_fleet_says_how_to_install_it(monkeypatch):
    def missing(name: str):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(transfer.importlib, "import_module", missing)
    with pytest.raises(CacheConfigError, match=r"^--fleet needs NIXL, which is not installed: pip install"):
        transfer.nixl()
