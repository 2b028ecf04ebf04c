"""The cache's GPU tier within ``--device-budget``: least recently used copies evicted to make room, a copy larger
than the budget refused before anything is allocated; in a fleet, each copy of a remote file offered to peers and
withdrawn before its memory goes, and copies the fleet makes made once. The driver calls are replaced here by a
ledger of allocations (a unit test of the tier's bookkeeping; tests/test_cache_gpu_tier.py and
tests/test_fleet_gpu.py run the real calls on a GPU)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from weightstream.errors import CacheFullError, FleetPeerError
from weightstream.nodecache.daemon import device as tier_module
from weightstream.nodecache.daemon.device import DeviceTier

MIB = 1 << 20


class Ledger:
    """Stands for the driver: allocations made and released, in order."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.made: list[int] = []
        self.mapped: set[int] = set()
        """Addresses of read-only mappings (the fleet's offers) not unmapped yet."""
        self.events: list[str] = []
        ledger = self

        class Copy:
            def __init__(self, nbytes: int, index: int, what: str, write: Callable[[int], None]) -> None:
                self.nbytes = self.allocation_bytes = nbytes
                self.fd = 100 + len(ledger.made)
                if write is not None:  # None: a copy from a segment (no driver to copy with here)
                    write(self.fd << 32)  # raising, as the real copy does once it released its allocation
                ledger.made.append(nbytes)
                ledger.live[self.fd] = nbytes
                ledger.events.append(f"made {what}")

            def map_read_only(self) -> int:
                ledger.mapped.add(self.fd << 32)
                return self.fd << 32

            def release(self) -> None:
                del ledger.live[self.fd]
                ledger.events.append(f"released {self.fd}")

        self.Copy = Copy


@pytest.fixture
def ledger(monkeypatch, tmp_path: Path) -> Ledger:
    ledger = Ledger()
    monkeypatch.setattr(tier_module.vmm, "gpu_uuid", lambda index: f"GPU-{index}")
    monkeypatch.setattr(tier_module.vmm, "allocation_bytes", lambda nbytes, index: nbytes)
    monkeypatch.setattr(tier_module.vmm, "ExportedCopy", ledger.Copy)
    monkeypatch.setattr(tier_module.vmm, "host_writer", lambda address, nbytes, what: None)
    monkeypatch.setattr(tier_module.vmm, "on_device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(tier_module.vmm, "unmap_allocation", lambda address, nbytes: ledger.mapped.remove(address))
    monkeypatch.setattr(tier_module, "map_read_only", lambda fd, nbytes, what: torch.empty(0))
    monkeypatch.setattr(tier_module.os, "dup", lambda fd: fd)
    return ledger


def segment(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.write_bytes(b"\0")
    return str(path)


def test_copies_past_the_budget_evict_the_least_recently_used(ledger: Ledger, tmp_path: Path):
    tier = DeviceTier(["cuda:0"], budget=10 * MIB)
    for key in ("a", "b"):
        tier.copy_of(key, "GPU-0", segment(tmp_path, key), 4 * MIB, f"/m/{key}")
    tier.copy_of("a", "GPU-0", segment(tmp_path, "a"), 4 * MIB, "/m/a")  # a used again: b is now the oldest
    tier.copy_of("c", "GPU-0", segment(tmp_path, "c"), 4 * MIB, "/m/c")
    assert sorted(ledger.live.values()) == [4 * MIB, 4 * MIB] and ledger.made == [4 * MIB] * 3
    assert tier.status()["GPU-0"] == {"index": 0, "budget": 10 * MIB, "entries": 2, "bytes": 8 * MIB}
    assert {key for key, _ in tier._entries} == {"a", "c"}


def test_a_copy_larger_than_the_budget_is_refused_before_allocating(ledger: Ledger, tmp_path: Path):
    tier = DeviceTier(["cuda:0"], budget=10 * MIB)
    tier.copy_of("a", "GPU-0", segment(tmp_path, "a"), 4 * MIB, "/m/a")
    with pytest.raises(CacheFullError, match=r"^/m/big: its 12582912-byte device copy is larger than --device-budget"):
        tier.copy_of("big", "GPU-0", segment(tmp_path, "big"), 12 * MIB, "/m/big")
    assert ledger.made == [4 * MIB], "allocated before refusing"
    assert list(ledger.live.values()) == [4 * MIB], "evicted for a copy that could never fit"
    tier.close()
    assert ledger.live == {}


def test_a_device_budget_without_a_device_is_refused(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "weightstream.cli", "cache", "serve", "--dir", str(tmp_path / "segments")]
        + ["--socket", str(tmp_path / "c.sock"), "--device-budget", "8GiB"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stderr.strip()) == (
        1,
        "weightstream: error: --device-budget without --device: the daemon keeps no device copies to bound",
    )
    assert not (tmp_path / "c.sock").exists()


class Offers:
    """Stands for the fleet: what the tier offered and withdrew, in order with the ledger's events."""

    def __init__(self, ledger: Ledger, fail: bool = False) -> None:
        self.ledger, self.fail = ledger, fail
        self.offered: dict[tuple[str, str], tuple[int, int]] = {}

    def offer(self, key: str, uuid: str, address: int, nbytes: int) -> None:
        if self.fail:
            raise OSError("etcd said no")
        assert address in self.ledger.mapped, "offered memory that is not mapped"
        self.offered[key, uuid] = (address, nbytes)
        self.ledger.events.append(f"offered {key}")

    def withdraw(self, key: str, uuid: str) -> None:
        address, _ = self.offered.pop((key, uuid))
        assert address in self.ledger.mapped, "withdrawn after its memory was unmapped"
        self.ledger.events.append(f"withdrew {key}")


def test_copies_of_remote_files_are_offered_and_withdrawn_before_their_memory_goes(ledger: Ledger, tmp_path: Path):
    tier = DeviceTier(["cuda:0"], budget=10 * MIB)
    tier.offers = offers = Offers(ledger)
    tier.copy_of("a", "GPU-0", segment(tmp_path, "a"), 4 * MIB, "s3://bucket/a")
    tier.copy_of("local", "GPU-0", segment(tmp_path, "local"), 4 * MIB, "/m/local")  # a path is this node's alone
    assert offers.offered == {("a", "GPU-0"): (100 << 32, 4 * MIB)}
    tier.copy_of("b", "GPU-0", segment(tmp_path, "b"), 4 * MIB, "s3://bucket/b")  # past the budget: a, the oldest, goes
    assert ledger.events[3:] == ["withdrew a", "released 100", "made s3://bucket/b", "offered b"], ledger.events
    tier.drop("b")
    tier.close()
    assert ledger.events[-3:] == ["withdrew b", "released 102", "released 101"], ledger.events
    assert (ledger.live, ledger.mapped, offers.offered) == ({}, set(), {})


def test_a_copy_the_fleet_cannot_be_told_of_still_serves_this_node(ledger: Ledger, tmp_path: Path, caplog):
    tier = DeviceTier(["cuda:0"])
    tier.offers = Offers(ledger, fail=True)
    fd, allocation_bytes = tier.copy_of("a", "GPU-0", segment(tmp_path, "a"), 4 * MIB, "gs://bucket/a")
    assert (fd, allocation_bytes) == (100, 4 * MIB)
    assert "gs://bucket/a on GPU-0: not offered to the fleet: etcd said no" in caplog.text
    assert ledger.mapped == set(), "the mapping for peers outlived the failed offer"
    tier.close()
    assert ledger.live == {}


def test_a_copy_made_by_the_fleet_is_made_once_and_a_failed_one_leaves_nothing(ledger: Ledger, tmp_path: Path):
    tier = DeviceTier(["cuda:0"])
    written = []

    def failing(address: int) -> None:
        raise FleetPeerError("peer-a: gone")

    assert tier.make("a", "GPU-0", 4 * MIB, "s3://b/a", written.append) is True
    assert tier.make("a", "GPU-0", 4 * MIB, "s3://b/a", written.append) is False, "made twice"
    with pytest.raises(FleetPeerError, match="^peer-a: gone$"):
        tier.make("b", "GPU-0", 4 * MIB, "s3://b/b", failing)
    assert written == [100 << 32] and tier.status()["GPU-0"]["entries"] == 1
    assert list(ledger.live) == [100], "the failed copy was kept"
    tier.close()
    assert ledger.live == {}
