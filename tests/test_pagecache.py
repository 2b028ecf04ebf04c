"""Cold and warm page-cache control used by the benchmarks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import weightstream
from weightstream.bench import runner
from weightstream.errors import BenchmarkError
from weightstream.save.write import write_safetensors
from weightstream.sources.local.pagecache import drop, resident_fraction, warm


def test_drop_then_warm(tmp_path: Path):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(8 << 20))
    warm(str(path))
    assert resident_fraction(str(path)) == 1.0
    drop(str(path))
    assert resident_fraction(str(path)) < 0.02
    warm(str(path))
    assert resident_fraction(str(path)) == 1.0


def test_page_cache_residency_of_a_checkpoint_directory(tmp_path: Path):
    for number in (1, 2):
        write_safetensors(tmp_path / f"model-{number}.safetensors", {f"w{number}": torch.zeros(1 << 20)})
    first, second = (str(tmp_path / f"model-{number}.safetensors") for number in (1, 2))
    warm(first)
    warm(second)
    assert weightstream.page_cache_residency(tmp_path) == 1.0
    drop(second)
    assert 0.45 < weightstream.page_cache_residency(tmp_path) < 0.55
    drop(first)
    assert weightstream.page_cache_residency(tmp_path) < 0.02


def test_bench_prepares_a_file_the_kernel_evicts_again(tmp_path: Path, monkeypatch):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(8 << 20))
    drop(str(path))
    reads = []

    def evicted_after_first_read(name: str) -> None:
        reads.append(name)
        warm(name)
        if len(reads) == 1:
            drop(name)

    monkeypatch.setattr(runner.pagecache, "warm", evicted_after_first_read)
    runner.prepare_cache([str(path)], "warm")
    assert reads == [str(path), str(path)]
    assert resident_fraction(str(path)) == 1.0


def test_bench_refuses_a_file_that_stays_out_of_the_page_cache(tmp_path: Path, monkeypatch):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(8 << 20))
    drop(str(path))
    monkeypatch.setattr(runner.pagecache, "warm", drop)
    with pytest.raises(
        BenchmarkError,
        match=r"blob: 0% resident in the page cache after preparing a warm run 3 times "
        r"\([0-9.]+ GiB available\); the figure would be wrong",
    ):
        runner.prepare_cache([str(path)], "warm")


def test_a_sampled_residency_tells_a_half_cached_file_from_a_cached_and_a_dropped_one(tmp_path: Path):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(256 << 20))
    warm(str(path))
    assert resident_fraction(str(path), sampled=True) == 1.0
    drop(str(path))
    assert resident_fraction(str(path), sampled=True) < 0.02
    with open(path, "rb") as file:  # the first half read back in
        file.read(128 << 20)
    assert 0.4 < resident_fraction(str(path), sampled=True) < 0.6
    assert 0.45 < resident_fraction(str(path)) < 0.55
