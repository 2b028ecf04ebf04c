"""GPUDirect Storage: where cuFile cannot run, "auto" falls back with the reason and True raises it;
where it can, loads are bit-exact (the GPU tests)."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

import weightstream
from tests.conftest import Destination, assert_same, save_hf_sharded
from weightstream.errors import InvalidOptionError
from weightstream.memory import gds

NO_CUFILE_HERE = pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("cuda.bindings") is None,
    reason="cuFile's absence, seen where cuda-python is installed and there is no GPU",
)


@NO_CUFILE_HERE
def test_the_reason_names_what_is_missing():
    reason = gds.unavailable_reason(need_nvidia_fs=False)
    assert reason is not None and reason.startswith("cuFileDriverOpen failed: ")
    assert "libcufile" in reason


def test_gds_needs_a_gpu_destination():
    with pytest.raises(InvalidOptionError, match=r"gds=True reads into GPU memory; device 'cpu' is not a GPU"):
        weightstream.LoadOptions(gds=True)
    with pytest.raises(InvalidOptionError, match=r"gds must be True, False or 'auto', got 'on'"):
        weightstream.LoadOptions(device="cuda", gds="on")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gds_true_loads_bit_exact_or_raises_the_reason(tmp_path, tiny_state, no_leaks):
    uri = save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2)
    reason = gds.unavailable_reason(need_nvidia_fs=False)
    if reason is None:
        assert_same(weightstream.load_weights(uri, device="cuda", gds=True), tiny_state, Destination("gds", {}, "cuda"))
    else:
        with pytest.raises(weightstream.DeviceUnavailableError, match="gds=True: GPUDirect Storage is not available: "):
            weightstream.load_weights(uri, device="cuda", gds=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gds_auto_says_why_it_uses_the_ring(tmp_path, tiny_state, caplog, no_leaks):
    uri = save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2)
    with caplog.at_level(logging.INFO, logger="weightstream.readers.parallel"):
        loaded = weightstream.load_weights(uri, device="cuda", gds="auto")
    assert_same(loaded, tiny_state, Destination("gds-auto", {}, "cuda"))
    reason = gds.unavailable_reason(need_nvidia_fs=True)
    if reason is not None:
        assert f"gds='auto': reading through the staging ring: {reason}" in caplog.text


@pytest.mark.skipif(importlib.util.find_spec("cuda.bindings") is None, reason="needs cuda-python's cuFile bindings")
def test_a_read_failing_with_an_errno_is_a_source_error_naming_it():
    """cuda-bindings turns cuFileRead's -1 (errno set) into ``cuFileError(errno)``, whose ``OpError(errno)`` raises
    ``ValueError: 5 is not a valid OpError``: the reader says what it meant, a typed error with the errno."""
    import threading

    from cuda.bindings import cufile

    from weightstream.errors import SourceError
    from weightstream.options import LoadOptions
    from weightstream.planning.plan import ReadRequest
    from weightstream.readers.gds import _read

    with pytest.raises(ValueError, match=r"^5 is not a valid OpError$"):
        cufile.cuFileError(5)  # the bindings' own behaviour, which the reader must translate

    class FailingCufile:
        cuFileError = cufile.cuFileError

        @staticmethod
        def read(handle, address, size, offset, destination_offset):
            raise cufile.cuFileError(5)

    request = ReadRequest(file="/m/model.safetensors", offset=4096, nbytes=8192, dest_offset=0)
    with pytest.raises(SourceError) as failed:
        _read(FailingCufile, "/m/model.safetensors", 1, 0, request, threading.Event(), LoadOptions())
    assert failed.value.errno == 5
    assert str(failed.value) == (
        "/m/model.safetensors: cuFileRead of bytes 4096..12288 failed at byte 4096: Input/output error (errno 5)"
    )
