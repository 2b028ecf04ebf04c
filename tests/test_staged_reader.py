"""The staged reader (reads land in ring slots, a copy engine moves them to the destination),
run with the CPU engine: what the CUDA path does, minus the device."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

import weightstream
from tests.conformance.test_round_trip import every_dtype
from tests.conftest import assert_same, save_hf_sharded, truncating_after_first_read
from tests.engines import DelayedCheckingEngine
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.memory.ring import CpuStaging
from weightstream.readers.staged import read_staged
from weightstream.sources import store_for

SMALL_RING = {"staging_slots": 2, "staging_slot_bytes": 8192, "chunk_bytes": 8192}


def staged_load(uri, staging=None, **options) -> dict[str, torch.Tensor]:
    return dict(staged_iter(uri, staging, **options))


def staged_iter(uri, staging=None, **options):
    with weightstream.open(uri, **options) as checkpoint:
        plan, opts = checkpoint.plan, checkpoint.options
    window = getattr(opts.loader_options, "max_inflight_bytes", None)
    return read_staged(store_for(plan.uri), plan, opts, staging or CpuStaging(), window)


@pytest.mark.parametrize("direct_io", [False, True])
def test_every_dtype_through_a_small_ring(tmp_path: Path, direct_io, no_leaks):
    state = every_dtype()
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=3)
    assert_same(staged_load(uri, direct_io=direct_io, **SMALL_RING), state)


@pytest.mark.parametrize("seed", range(4))
def test_random_delays_every_byte_lands_and_no_slot_is_reused_early(tmp_path: Path, seed, no_leaks):
    state = llama_state_dict(LlamaShape(hidden=128, intermediate=352, layers=4, vocab=500), seed=seed)
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=2)
    engines: list[DelayedCheckingEngine] = []

    def engine() -> DelayedCheckingEngine:
        engines.append(DelayedCheckingEngine(seed))
        return engines[-1]

    loaded = {}
    for name, tensor in staged_iter(uri, CpuStaging(engine), threads=6, direct_io=seed % 2 == 0, **SMALL_RING):
        assert torch.equal(tensor, state[name]), f"{name} was yielded before all its copies had finished"
        loaded[name] = tensor
    assert_same(loaded, state)
    assert engines[0].violations == []
    assert engines[0].launched > 100, "the checkpoint must pass through the ring many times over"


def test_tensors_larger_than_a_slot_and_a_filter(tmp_path: Path, no_leaks):
    state = {"big": torch.randn(70_000), "small": torch.arange(5), "skipped": torch.ones(40_000)}
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=1)
    loaded = staged_load(uri, filter=["big", "small"], **SMALL_RING)
    assert_same(loaded, {"big": state["big"], "small": state["small"]})


def test_a_failed_copy_stops_the_load_and_surfaces_once(tmp_path: Path, no_leaks):
    state = llama_state_dict(LlamaShape(hidden=128, intermediate=352, layers=4, vocab=500))
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=2)
    engine = CpuStaging(lambda: DelayedCheckingEngine(seed=5, fail_at=7))
    stream = staged_iter(uri, engine, threads=4, **SMALL_RING)
    with pytest.raises(OSError, match=r"copy 7 failed") as raised:
        for _ in stream:
            pass
    assert raised.value.__context__ is None, "the copy error was raised twice (once more by the ring's close)"


def test_file_truncated_during_a_staged_load(tmp_path: Path, no_leaks):
    state = llama_state_dict(LlamaShape(hidden=256, intermediate=704, layers=4, vocab=2000))
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=2)
    truncate_after_first_read = truncating_after_first_read(list(Path(uri).glob("*.safetensors")))
    with pytest.raises(weightstream.TruncatedFileError, match=r"file ends at byte \d+, expected bytes up to \d+"):
        staged_load(uri, progress=truncate_after_first_read, **SMALL_RING)


def test_consumer_abandoning_the_iterator_leaks_nothing(tmp_path: Path, no_leaks):
    state = llama_state_dict(LlamaShape(hidden=256, intermediate=704, layers=4, vocab=2000))
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=2)
    stream = staged_iter(uri, threads=4, **SMALL_RING)
    name, tensor = next(stream)
    assert torch.equal(tensor, state[name])
    stream.close()


def test_one_slot_many_readers(tmp_path: Path, no_leaks):
    state = llama_state_dict(LlamaShape(hidden=128, intermediate=352, layers=2, vocab=500))
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=1)
    loaded = staged_load(uri, threads=16, staging_slots=1, staging_slot_bytes=4096, chunk_bytes=4096)
    assert_same(loaded, state)


def test_a_failed_allocation_frees_the_earlier_files_at_once(tmp_path: Path, no_leaks):
    """A device too small for the last shard: the shards allocated before it are freed before the
    error reaches the caller, not when the caller drops the traceback."""
    state = llama_state_dict(LlamaShape(hidden=128, intermediate=352, layers=4, vocab=500))
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=3)
    allocated: list[weakref.ref] = []

    class SmallDevice(CpuStaging):
        def allocate(self, nbytes: int, file: str) -> torch.Tensor:
            if len(allocated) == 2:
                raise weightstream.DeviceMemoryError(f"{file}: cannot allocate {nbytes} bytes")
            buffer = super().allocate(nbytes, file)
            allocated.append(weakref.ref(buffer))
            return buffer

    with pytest.raises(
        weightstream.DeviceMemoryError, match=r"model-00003-of-00003.safetensors: cannot allocate"
    ) as raised:
        staged_load(uri, SmallDevice())
    assert raised.value.__traceback__ is not None, "the caller still holds the traceback"
    assert [ref() for ref in allocated] == [None, None], "earlier shards' buffers outlived the failed load"


class _Counted(bytearray):
    """Destination memory whose death the test can see (a bytearray cannot be weakly referenced)."""


class CountingStaging(CpuStaging):
    """CPU destination memory that counts the bytes alive (as a GPU's allocator would) and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.alive = self.peak = self.allocations = 0

    def allocate(self, nbytes: int, file: str) -> torch.Tensor:
        memory = _Counted(nbytes)
        self.alive += nbytes
        self.peak = max(self.peak, self.alive)
        self.allocations += 1
        weakref.finalize(memory, self._freed, nbytes)
        return torch.frombuffer(memory, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)

    def _freed(self, nbytes: int) -> None:
        self.alive -= nbytes


@pytest.mark.parametrize("max_inflight_bytes", [1 << 20, 3 << 20])
def test_destination_memory_is_bounded_by_the_window(tmp_path: Path, max_inflight_bytes, no_leaks):
    """A consumer that copies each tensor out and drops it (an engine filling its parameters) holds
    at most the window plus the tensor it was last given, not the checkpoint: 12 MiB through 1 MiB."""
    state = llama_state_dict(LlamaShape(hidden=256, intermediate=704, layers=8, vocab=1000))
    total = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
    largest = max(tensor.numel() * tensor.element_size() for tensor in state.values())
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=2)
    staging = CountingStaging()
    with weightstream.open(
        uri, format="streaming", max_inflight_bytes=max_inflight_bytes, chunk_bytes=256 << 10, threads=4
    ) as checkpoint:
        plan, opts = checkpoint.plan, checkpoint.options
    seen = set()
    for name, tensor in read_staged(store_for(plan.uri), plan, opts, staging, max_inflight_bytes):
        assert torch.equal(tensor, state[name])
        seen.add(name)
        del tensor
    assert seen == set(state)
    assert total > 3 * max_inflight_bytes
    assert staging.peak <= max_inflight_bytes + largest + 4096, f"{staging.peak} bytes of destination alive at once"
    assert staging.allocations > 8, "the checkpoint must pass through the window in many batches"
    assert staging.alive == 0


def test_max_inflight_bytes_too_small_for_a_tensor_is_refused_before_any_allocation(tmp_path: Path, no_leaks):
    uri = save_hf_sharded({"big": torch.zeros(1 << 18), "small": torch.zeros(4)}, tmp_path / "ckpt", shards=1)
    with pytest.raises(
        weightstream.InvalidOptionError, match=r"max_inflight_bytes=524288 \(0.5 MiB\) cannot hold tensor 'big'"
    ):
        weightstream.open(uri, format="streaming", max_inflight_bytes=512 << 10, chunk_bytes=256 << 10)
