"""LoadOptions: every bad option is rejected at call time, with a message naming it."""

from __future__ import annotations

import pytest

import weightstream
from weightstream import LoadOptions
from weightstream.errors import InvalidOptionError, OptionError


def test_defaults():
    opts = LoadOptions()
    assert (opts.device, opts.chunk_bytes, opts.filter, opts.huge_pages, opts.direct_io) == ("cpu", 8 << 20, None, "auto", "auto")
    assert opts.reader_threads >= 8


@pytest.mark.parametrize("kwargs, error, message", [
    ({"threads": 0}, InvalidOptionError, r"threads must be a positive integer or None, got 0"),
    ({"threads": True}, InvalidOptionError, r"threads must be a positive integer or None, got True"),
    ({"chunk_bytes": 100}, InvalidOptionError, r"chunk_bytes must be a positive multiple of 4096, got 100"),
    ({"device": "tpu:9"}, InvalidOptionError, r"device 'tpu:9' is not a device torch knows"),
    ({"device": 0}, OptionError, r"device must be a string such as 'cpu' or 'cuda:0', got int"),
    ({"filter": "lm_head.weight"}, OptionError, r"filter must be a collection of names or a predicate, not a single str"),
    ({"filter": [1]}, OptionError, r"filter names must be strings, got 1"),
    ({"filter": 3}, OptionError, r"filter must be a collection of names or a predicate, got int"),
    ({"huge_pages": "yes"}, InvalidOptionError, r"huge_pages must be True, False or 'auto', got 'yes'"),
    ({"prefault": 1}, OptionError, r"prefault must be a bool, got int"),
    ({"zero_copy": "yes"}, OptionError, r"zero_copy must be a bool, got str"),
    ({"direct_io": 1}, InvalidOptionError, r"direct_io must be True, False or 'auto', got 1"),
    ({"direct_io": "yes"}, InvalidOptionError, r"direct_io must be True, False or 'auto', got 'yes'"),
    ({"chunk_bytes": 6000}, InvalidOptionError, r"chunk_bytes must be a positive multiple of 4096, got 6000"),
    ({"progress": 5}, OptionError, r"progress must be callable, got int"),
])
def test_bad_values(kwargs, error, message):
    with pytest.raises(error, match=message):
        LoadOptions.from_kwargs(**kwargs)


def test_unknown_option_lists_known_ones():
    with pytest.raises(OptionError, match=r"unknown option\(s\) nthreads; known options: chunk_bytes, device, direct_io, filter, huge_pages, prefault, progress, threads, zero_copy"):
        LoadOptions.from_kwargs(nthreads=2)


def test_cuda_device_is_refused_by_the_cpu_only_loader(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(InvalidOptionError, match=r"device 'cuda:0': the safetensors loader supports only 'cpu' in this version"):
        weightstream.load_weights(tmp_path / "x.safetensors", device="cuda:0")


def test_filter_wants():
    assert LoadOptions(filter=["a"]).wants("a") and not LoadOptions(filter=["a"]).wants("b")
    assert LoadOptions(filter=lambda name: name.endswith("x")).wants("ax")
    assert LoadOptions().wants("anything")
