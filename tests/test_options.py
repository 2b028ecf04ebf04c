"""LoadOptions: every bad option is rejected at call time, with a message naming it."""

from __future__ import annotations

import pytest
import torch

import weightstream
from weightstream import LoadOptions
from weightstream.errors import InvalidOptionError, OptionError


def test_defaults():
    opts = LoadOptions()
    assert (opts.device, opts.chunk_bytes, opts.filter, opts.huge_pages, opts.direct_io) == (
        "cpu",
        None,
        None,
        "auto",
        "auto",
    )
    assert opts.request_bytes("/models/llama") == 8 << 20
    assert opts.request_bytes("s3://bucket/llama") == opts.request_bytes("https://host/llama/") == 64 << 20
    assert LoadOptions(chunk_bytes=1 << 20).request_bytes("gs://bucket/llama") == 1 << 20
    assert opts.reader_threads >= 8


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"threads": 0}, InvalidOptionError, r"threads must be a positive integer or None, got 0"),
        ({"threads": True}, InvalidOptionError, r"threads must be a positive integer or None, got True"),
        ({"chunk_bytes": 100}, InvalidOptionError, r"chunk_bytes must be a positive multiple of 4096 or None, got 100"),
        ({"device": "tpu:9"}, InvalidOptionError, r"device 'tpu:9' is not a device torch knows"),
        (
            {"device": 1.5},
            OptionError,
            r"device must be a string such as 'cpu' or 'cuda:0' \(or a torch.device, or N for 'cuda:N'\), got float",
        ),
        (
            {"filter": "lm_head.weight"},
            OptionError,
            r"filter must be a collection of names or a predicate, not a single str",
        ),
        ({"filter": [1]}, OptionError, r"filter names must be strings, got 1"),
        ({"filter": 3}, OptionError, r"filter must be a collection of names or a predicate, got int"),
        ({"huge_pages": "yes"}, InvalidOptionError, r"huge_pages must be True, False or 'auto', got 'yes'"),
        ({"prefault": 1}, OptionError, r"prefault must be a bool, got int"),
        ({"zero_copy": "yes"}, InvalidOptionError, r"zero_copy must be True, False or 'auto', got 'yes'"),
        ({"pin_memory": "always"}, InvalidOptionError, r"pin_memory must be True, False or 'auto', got 'always'"),
        ({"direct_io": 1}, InvalidOptionError, r"direct_io must be True, False or 'auto', got 1"),
        ({"direct_io": "yes"}, InvalidOptionError, r"direct_io must be True, False or 'auto', got 'yes'"),
        (
            {"chunk_bytes": 6000},
            InvalidOptionError,
            r"chunk_bytes must be a positive multiple of 4096 or None, got 6000",
        ),
        ({"progress": 5}, OptionError, r"progress must be callable, got int"),
        ({"staging_slots": 0}, InvalidOptionError, r"staging_slots must be a positive integer, got 0"),
        ({"staging_slot_bytes": 5000}, InvalidOptionError, r"staging_slot_bytes must be a multiple of 4096, got 5000"),
        (
            {"staging_slots": 300, "staging_slot_bytes": 16 << 20},
            InvalidOptionError,
            r"staging_slots x staging_slot_bytes = 300 x 16777216 bytes exceeds the 4 GiB bound on pinned staging",
        ),
        (
            {"device": "cuda", "pin_memory": True},
            InvalidOptionError,
            r"pin_memory=True is for CPU destinations; device 'cuda' is not one",
        ),
        (
            {"device": "cuda:0", "zero_copy": True},
            InvalidOptionError,
            r"zero_copy=True on a GPU views the node cache daemon's device copies: it needs cache=",
        ),
        (
            {"pin_memory": True, "zero_copy": True},
            InvalidOptionError,
            r"zero_copy returns views of a file mapping: it cannot land in pinned memory",
        ),
    ],
)
def test_bad_values(kwargs, error, message):
    with pytest.raises(error, match=message):
        LoadOptions.from_kwargs(**kwargs)


def test_unknown_option_lists_known_ones():
    with pytest.raises(
        OptionError,
        match=r"unknown option\(s\) nthreads; known options: cache, chunk_bytes, deadline_s, device, direct_io, "
        r"filter, gds, huge_pages, pin_memory, prefault, progress, request_timeout_s, retries, staging_slot_bytes, "
        r"staging_slots, storage_options, threads, zero_copy$",
    ):
        LoadOptions.from_kwargs(nthreads=2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_device_this_machine_lacks_is_refused(tmp_path, no_leaks):
    (tmp_path / "x.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(
        weightstream.DeviceUnavailableError, match=rf"device '{missing}' requested, but this machine has"
    ):
        weightstream.load_weights(tmp_path / "x.safetensors", device=missing)


def test_filter_wants():
    assert LoadOptions(filter=["a"]).wants("a") and not LoadOptions(filter=["a"]).wants("b")
    assert LoadOptions(filter=lambda name: name.endswith("x")).wants("ax")
    assert LoadOptions().wants("anything")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"device": "cuda"},
            r"device 'cuda' requested, but torch .* sees no CUDA device; nothing falls back to the CPU",
        ),
        ({"device": "cuda:1"}, r"device 'cuda:1' requested, but torch .* sees no CUDA device"),
        (
            {"pin_memory": True},
            r"pin_memory=True needs CUDA .* use pin_memory='auto' to pin only where CUDA is present",
        ),
    ],
)
def test_cuda_destinations_refused_without_cuda(tmp_path, options, message, no_leaks):
    (tmp_path / "x.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(weightstream.DeviceUnavailableError, match=message):
        weightstream.iter_weights(tmp_path / "x.safetensors", **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="'auto' pins where CUDA is present")
def test_pin_memory_auto_without_cuda_loads_pageable(tmp_path, no_leaks):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(3)}, str(tmp_path / "x.safetensors"))
    loaded = weightstream.load_weights(tmp_path / "x.safetensors", pin_memory="auto")
    assert not loaded["w"].is_pinned() and loaded["w"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("device", ["meta", "xpu", "mps", "hpu", "xla"])
def test_devices_weightstream_cannot_land_on_are_refused_not_loaded_to_the_cpu(device, tmp_path):
    with pytest.raises(
        InvalidOptionError,
        match=rf"device '{device}': weightstream lands tensors on cpu or cuda devices only; nothing falls back to the "
        r"CPU",
    ):
        weightstream.load_weights(str(tmp_path), device=device)


def test_there_is_one_cpu(tmp_path):
    with pytest.raises(InvalidOptionError, match=r"device 'cpu:1': there is one CPU device, 'cpu'"):
        weightstream.load_weights(str(tmp_path), device="cpu:1")


@pytest.mark.parametrize(("cpus", "threads"), [(1, 8), (4, 8), (16, 32), (32, 64), (192, 64)])
def test_default_threads_are_twice_the_cpus_within_8_and_64(monkeypatch, cpus, threads):
    monkeypatch.setattr("os.cpu_count", lambda: cpus)
    assert LoadOptions().reader_threads == threads
    assert LoadOptions(threads=300).reader_threads == 300  # what the caller asks for is theirs
