"""The cache's GPU tier within ``--device-budget``: least recently used copies evicted to make room, a copy larger
than the budget refused before anything is allocated. The driver calls are replaced here by a ledger of allocations
(a unit test of the tier's bookkeeping; tests/test_cache_gpu_tier.py runs the real calls on a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weightstream.errors import CacheFullError
from weightstream.nodecache.daemon import device as tier_module
from weightstream.nodecache.daemon.device import DeviceTier

MIB = 1 << 20


class Ledger:
    """Stands for the driver: allocations made and released, in order."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.made: list[int] = []
        ledger = self

        class Copy:
            def __init__(self, host_address: int, nbytes: int, index: int, what: str) -> None:
                self.allocation_bytes, self.fd = nbytes, 100 + len(ledger.made)
                ledger.made.append(nbytes)
                ledger.live[self.fd] = nbytes

            def release(self) -> None:
                del ledger.live[self.fd]

        self.Copy = Copy


@pytest.fixture
def ledger(monkeypatch, tmp_path: Path) -> Ledger:
    ledger = Ledger()
    monkeypatch.setattr(tier_module.vmm, "gpu_uuid", lambda index: f"GPU-{index}")
    monkeypatch.setattr(tier_module.vmm, "allocation_bytes", lambda nbytes, index: nbytes)
    monkeypatch.setattr(tier_module.vmm, "ExportedCopy", ledger.Copy)
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
