"""Every registered loader: a read that fails midway stops everything, frees memory, leaks nothing."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
import torch

import weightstream
from tests.conformance.conftest import CASES
from tests.conformance.writers import refuses, running
from tests.conftest import truncating_after_first_read
from weightstream.bench.demo import LlamaShape, llama_state_dict

MIB = 1 << 20


@pytest.fixture(scope="module")
def big_state() -> dict[str, torch.Tensor]:
    """About 192 MiB, so that freed memory shows in RSS; drawn once (0.7 s), written afresh for each test."""
    return llama_state_dict(LlamaShape(hidden=1024, intermediate=2816, layers=8, vocab=8000))


@pytest.fixture(params=CASES, ids=[f"{name}-{writer.__name__}" for name, writer in CASES])
def big_checkpoint(request, big_state, tmp_path: Path):
    name, writer = request.param
    uri = writer(big_state, tmp_path / "ckpt")
    with running(name, tmp_path):
        yield name, uri


def settled_rss() -> int:
    """RSS once the heap has given back what earlier frees left in it (the fixture's state dict): glibc keeps
    freed heap memory until a trim, which any later allocation may trigger mid-measurement."""
    import ctypes

    ctypes.CDLL(None).malloc_trim(0)
    return psutil.Process().memory_info().rss


def files_of(uri: str) -> list[Path]:
    return sorted(Path(uri).glob("*.safetensors")) if Path(uri).is_dir() else [Path(uri)]


def test_file_truncated_during_load(big_checkpoint, no_leaks):
    name, uri = big_checkpoint
    truncate_after_first_read = truncating_after_first_read(files_of(uri))
    baseline = settled_rss()
    with pytest.raises(
        weightstream.TruncatedFileError,
        match=r"file ends at byte \d+, expected bytes up to \d+ \(it changed or shrank while loading\)",
    ):
        weightstream.load_weights(uri, format=name, chunk_bytes=MIB, progress=truncate_after_first_read)
    assert psutil.Process().memory_info().rss - baseline < 32 * MIB, "the arenas of a failed load were not released"


@pytest.mark.parametrize("zero_copy", [False, True])
def test_file_changed_between_plan_and_read(big_checkpoint, zero_copy, no_leaks):
    name, uri = big_checkpoint
    if refuses(name, {"zero_copy": zero_copy}, uri):
        return
    stream = weightstream.iter_weights(uri, format=name, zero_copy=zero_copy)
    victim = files_of(uri)[0]
    with open(victim, "ab") as file:
        file.write(b"more")
    with pytest.raises(
        weightstream.SourceChangedError,
        match=r"is \d+ bytes now, \d+ when its header was read \(it changed while loading\)",
    ):
        next(stream)


def test_memory_released_after_success(big_checkpoint, no_leaks):
    name, uri = big_checkpoint
    baseline = settled_rss()
    loaded = weightstream.load_weights(uri, format=name)
    assert psutil.Process().memory_info().rss - baseline > 150 * MIB
    del loaded
    assert psutil.Process().memory_info().rss - baseline < 32 * MIB


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_file_truncated_during_a_gpu_load_frees_device_memory(big_checkpoint, no_leaks):
    name, uri = big_checkpoint
    truncate_after_first_read = truncating_after_first_read(files_of(uri))
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    with pytest.raises(weightstream.TruncatedFileError, match=r"file ends at byte \d+, expected bytes up to \d+"):
        weightstream.load_weights(uri, format=name, device="cuda", chunk_bytes=MIB, progress=truncate_after_first_read)
    assert torch.cuda.memory_allocated() == baseline, "device buffers of a failed load were not released"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_load_larger_than_the_device_is_a_typed_error(tmp_path: Path, no_leaks):
    free, _ = torch.cuda.mem_get_info()
    path = tmp_path / "huge.safetensors"
    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [free + (1 << 30)], "data_offsets": [0, free + (1 << 30)]}}
    ).encode()
    with open(path, "wb") as file:
        file.write(len(header).to_bytes(8, "little") + header)
        file.truncate(8 + len(header) + free + (1 << 30))  # sparse: no disk used
    with pytest.raises(
        weightstream.DeviceMemoryError, match=r"huge.safetensors: cannot allocate \d+ bytes on cuda:\d+ for its tensors"
    ):
        weightstream.load_weights(path, device="cuda")
