"""Pinned arenas: registered with cudaHostRegister, unregistered when the last tensor dies and
before the memory is unmapped; a driver that refuses gives a typed error and frees the mapping."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import re

import pytest
import torch

import weightstream
from weightstream.memory import pinning
from weightstream.memory.host import HostArena
from weightstream.planning.plan import TensorSpec


def test_pages_are_unregistered_after_the_last_tensor_and_while_still_mapped(monkeypatch, no_leaks):
    calls = []
    monkeypatch.setattr(pinning, "register", lambda address, nbytes: calls.append(("register", address, nbytes)))
    # A read through the address would fault if the mapping were already gone.
    monkeypatch.setattr(
        pinning, "unregister", lambda address: calls.append(("unregister", address, ctypes.string_at(address, 2)))
    )
    arena = HostArena(8192, huge_pages=False, pinned=True)
    arena.view[:2] = b"\x07\x09"
    tensor = arena.tensor(0, TensorSpec("w", torch.uint8, (2,), "f", 0, 2))
    del arena
    gc.collect()
    assert [call[0] for call in calls] == ["register"], "unregistered while a tensor still viewed the pages"
    address = calls[0][1]
    assert tensor.data_ptr() == address and calls[0][2] == 8192
    del tensor
    gc.collect()
    assert calls[1:] == [("unregister", address, b"\x07\x09")]


@pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("cuda.bindings") is None,
    reason="the driver's refusal, seen where cuda-python is installed and there is no GPU",
)
def test_a_refused_registration_is_a_typed_error_and_frees_the_mapping(no_leaks):
    with pytest.raises(
        weightstream.DeviceUnavailableError,
        match=r"cudaHostRegister of 8192 bytes at 0x[0-9a-f]+ failed: cudaError\w+ \(",
    ) as raised:
        HostArena(8192, huge_pages=False, pinned=True)
    address = int(re.search(r"at (0x[0-9a-f]+)", str(raised.value)).group(1), 16)
    assert not mapped(address), "the arena's mapping outlived the failed registration"


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(bound, 16) for bound in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cuda.bindings") is None,
    reason="needs CUDA and cuda-python",
)
def test_pinned_load_registers_exactly_its_buffers_and_releases_them(tmp_path, tiny_state, no_leaks):
    from tests.conftest import save_hf_sharded

    uri = save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2)
    before, _ = pinning.registered_bytes()
    loaded = weightstream.load_weights(uri, pin_memory=True)
    assert all(tensor.is_pinned() for tensor in loaded.values() if tensor.numel())
    now, _ = pinning.registered_bytes()
    assert 0 < now - before < sum(t.numel() * t.element_size() for t in tiny_state.values()) + 2 * 2 * 4096
    del loaded
    gc.collect()
    assert pinning.registered_bytes()[0] == before


def test_registering_for_a_device_leaves_the_threads_current_device_as_it_was(monkeypatch):
    """The runtime registers on the device asked for (a caller on GPU 1 must not start a context on GPU 0) and the
    thread's current device is restored; the unregistration runs on the same device. A fake runtime records the
    calls (the real ones need a driver: the CUDA tests run them)."""
    import types

    from weightstream.memory import pinning

    calls = []
    success = object()
    runtime = types.SimpleNamespace(
        cudaHostRegisterPortable=1,
        cudaHostRegisterReadOnly=8,
        cudaError_t=types.SimpleNamespace(cudaSuccess=success),
        cudaGetDevice=lambda: (success, 0),
        cudaSetDevice=lambda device: calls.append(("set", device)),
        cudaHostRegister=lambda address, nbytes, flags: calls.append(("register", flags)) or (success,),
        cudaHostUnregister=lambda address: calls.append(("unregister",)) or (success,),
    )
    monkeypatch.setattr(pinning, "_runtime", lambda: runtime)
    pinning.register(0x1000, 4096, read_only=True, device=1)
    pinning.unregister(0x1000)
    assert calls == [("set", 1), ("register", 9), ("set", 0), ("set", 1), ("unregister",), ("set", 0)]
    assert pinning.registered_bytes()[0] == 0
