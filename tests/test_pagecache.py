"""Cold and warm page-cache control used by the benchmarks."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import weightstream
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
