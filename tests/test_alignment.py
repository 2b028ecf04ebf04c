"""Tensors whose bytes sit at offsets their dtype cannot view get an aligned copy, bit-exact."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import weightstream


@pytest.mark.parametrize("direct_io", [False, True])
def test_misaligned_tensor_is_copied_to_aligned_memory(tmp_path: Path, direct_io, no_leaks):
    floats = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float32)
    header = json.dumps(
        {
            "odd": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
            "f32": {"dtype": "F32", "shape": [3], "data_offsets": [3, 15]},
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "misaligned.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x07\x08\x09" + floats.numpy().tobytes())
    loaded = weightstream.load_weights(path, direct_io=direct_io)
    assert loaded["odd"].tolist() == [7, 8, 9]
    assert torch.equal(loaded["f32"], floats)
    assert loaded["f32"].data_ptr() % 4 == 0


def misaligned_checkpoint(path: Path) -> torch.Tensor:
    """A checkpoint whose int64 tensor starts 3 bytes into the data section; the tensor."""
    values = torch.arange(24, dtype=torch.int64).reshape(4, 6)
    header = json.dumps(
        {
            "odd": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
            "i64": {"dtype": "I64", "shape": [4, 6], "data_offsets": [3, 3 + values.nbytes]},
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x07\x08\x09" + values.numpy().tobytes())
    return values


@pytest.mark.parametrize("format", ["safetensors", "streaming", "layered"])
def test_a_slice_of_a_misaligned_tensor_is_read_as_get_tensor_reads_it(tmp_path: Path, format, no_leaks):
    values = misaligned_checkpoint(tmp_path / "misaligned.safetensors")
    with weightstream.open(tmp_path / "misaligned.safetensors", format) as checkpoint:
        assert torch.equal(checkpoint.get_slice("i64")[1:3, 2:5], values[1:3, 2:5])
        assert torch.equal(checkpoint.get_slice("i64")[2], values[2])
        assert torch.equal(checkpoint.get_tensor("i64"), values)


def test_a_slice_of_a_misaligned_tensor_through_the_cache(tmp_path: Path, no_leaks):
    from tests.cache_daemon import running_daemon

    values = misaligned_checkpoint(tmp_path / "misaligned.safetensors")
    with (
        running_daemon("align") as daemon,
        weightstream.open(tmp_path / "misaligned.safetensors", cache=str(daemon.socket)) as checkpoint,
    ):
        assert torch.equal(checkpoint.get_slice("i64")[1:3, 2:5], values[1:3, 2:5])
