"""Where a CUDA load through the node cache copies a file from, when the daemon's device copy cannot be had: the
host segment, with one warning, unless ``zero_copy=True`` asked for views of the device copy (then the error). A unit
test of the choice (the driver calls themselves need a GPU: tests/test_cache_gpu_tier.py runs them there)."""

from __future__ import annotations

import collections
import logging

import pytest

from weightstream.errors import CacheUnavailableError, DeviceMemoryError
from weightstream.nodecache import gpu_import
from weightstream.nodecache.gpu_import import SegmentCopies


class Segment:
    uri = "/models/llama/model-00001-of-00002.safetensors"
    size = 4096


class DaemonGone:
    def device_copy(self, segment, uuid):
        raise CacheUnavailableError("the cache daemon at /run/weightstream/cache.sock closed the connection")


def copies(strict: bool) -> SegmentCopies:
    chosen = SegmentCopies.__new__(SegmentCopies)
    chosen.index, chosen.uuid, chosen.locks_read_only, chosen.strict = 0, "GPU-0000", True, strict
    chosen.routes = collections.Counter()
    return chosen


def test_a_device_copy_that_cannot_be_had_falls_back_to_the_host_segment(monkeypatch, caplog):
    host = object()
    monkeypatch.setattr(gpu_import, "map_read_only", lambda fd, size, page_locked, what, device: host)
    chosen = copies(strict=False)
    with caplog.at_level(logging.WARNING, logger="weightstream"):
        assert chosen(DaemonGone(), Segment(), 3, {"gpus": ["GPU-0000"]}) is host
    assert chosen.routes == {"page-locked": 1}
    assert caplog.messages == [
        (
            f"{Segment.uri}: no device copy (the cache daemon at /run/weightstream/cache.sock closed the connection); "
            "copying from the host's shared memory"
        )
    ]


def test_a_refused_import_falls_back_too(monkeypatch, caplog):
    class Refusing:
        def device_copy(self, segment, uuid):
            return 7, 8192

    def refuse(*args):
        raise DeviceMemoryError("cuMemSetAccess failed: CUDA_ERROR_NOT_SUPPORTED")

    closed = []
    monkeypatch.setattr(gpu_import.vmm, "import_read_only", refuse)
    monkeypatch.setattr(gpu_import.os, "close", closed.append)
    monkeypatch.setattr(gpu_import, "map_read_only", lambda fd, size, page_locked, what, device: "host")
    with caplog.at_level(logging.WARNING, logger="weightstream"):
        assert copies(strict=False)(Refusing(), Segment(), 3, {"gpus": ["GPU-0000"]}) == "host"
    assert closed == [7], "the device copy's descriptor was not closed"
    assert "cuMemSetAccess failed" in caplog.text


def test_zero_copy_true_stays_strict(monkeypatch):
    monkeypatch.setattr(gpu_import, "map_read_only", lambda *args, **kwargs: pytest.fail("fell back to the host"))
    with pytest.raises(CacheUnavailableError, match="closed the connection"):
        copies(strict=True)(DaemonGone(), Segment(), 3, {"gpus": ["GPU-0000"]})


def test_a_driver_that_cannot_lock_read_only_memory_is_counted_as_the_ring(monkeypatch):
    chosen = copies(strict=False)
    chosen.locks_read_only = False
    monkeypatch.setattr(gpu_import, "map_read_only", lambda *args, **kwargs: pytest.fail("locked anyway"))
    assert chosen(DaemonGone(), Segment(), 3, {"gpus": []}) is None
    assert chosen.routes == {"staging-ring": 1}
