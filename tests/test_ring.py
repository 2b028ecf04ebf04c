"""The staging ring under stress, with the CPU copy engine and random delays in every stage."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from tests.engines import DelayedCheckingEngine
from weightstream.memory.ring import CpuCopyEngine, RingClosedError, StagingRing


def run_readers(ring: StagingRing, data: torch.Tensor, destination: torch.Tensor, chunk: int, readers: int, seed: int):
    """Reader threads stage chunks of ``data`` into slots and launch copies to ``destination``."""
    chunks = list(range(0, data.numel(), chunk))
    lock, errors = threading.Lock(), []

    def reader(number: int) -> None:
        pace = random.Random(seed + number)
        while True:
            with lock:
                if not chunks:
                    return
                start = chunks.pop()
            end = min(start + chunk, data.numel())
            try:
                slot = ring.acquire()
                time.sleep(pace.random() * 0.002)  # the "read" into the slot takes a while
                slot.buffer[: end - start].copy_(data[start:end])
                ring.launch(slot, end - start, destination[start:end])
            except BaseException as error:  # noqa: BLE001 - the test hands every failure of the thread to the main thread
                with lock:
                    errors.append(error)
                return

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


@pytest.mark.parametrize("seed", range(6))
def test_every_byte_lands_and_no_slot_is_reused_early(seed, no_leaks):
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (3_000_000 + seed * 7919,), dtype=torch.uint8, generator=generator)
    destination = torch.zeros_like(data)
    engine = DelayedCheckingEngine(seed)
    ring = StagingRing(engine, slot_bytes=65_536, slots=3)
    errors = run_readers(ring, data, destination, chunk=60_000 + seed * 997, readers=4, seed=seed)
    ring.close()
    assert errors == []
    assert engine.violations == []
    assert torch.equal(destination, data)
    assert engine.launched == -(-data.numel() // (60_000 + seed * 997))


def test_a_failed_copy_stops_the_readers_and_surfaces_once(no_leaks):
    data = torch.randint(0, 256, (2_000_000,), dtype=torch.uint8)
    engine = DelayedCheckingEngine(seed=1, fail_at=5)
    ring = StagingRing(engine, slot_bytes=65_536, slots=2)
    errors = run_readers(ring, data, torch.zeros_like(data), chunk=50_000, readers=3, seed=1)
    assert errors, "the readers must see the failed copy"
    assert all(isinstance(e, OSError) and str(e) == "[Errno 5] copy 5 failed" for e in errors)
    assert all(e is errors[0] for e in errors), "one error, not one per reader"
    assert engine.launched < 2_000_000 // 50_000, "readers went on launching after the failure"
    ring.close()  # already seen: not raised again


def test_an_unseen_copy_error_is_raised_by_close(no_leaks):
    engine = DelayedCheckingEngine(seed=2, fail_at=1)
    ring = StagingRing(engine, slot_bytes=16, slots=2)
    slot = ring.acquire()
    ring.launch(slot, 16, torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(OSError, match="copy 1 failed"):
        ring.close()


def test_close_wakes_readers_waiting_for_a_slot(no_leaks):
    ring = StagingRing(CpuCopyEngine(), slot_bytes=16, slots=1)
    held = ring.acquire()
    outcome: list[BaseException] = []
    waiter = threading.Thread(target=lambda: outcome.append(_acquire_error(ring)))
    waiter.start()
    time.sleep(0.05)
    ring.close()
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    assert isinstance(outcome[0], RingClosedError)
    ring.release(held)


def test_released_slot_is_handed_out_again(no_leaks):
    ring = StagingRing(CpuCopyEngine(), slot_bytes=16, slots=1)
    slot = ring.acquire()
    ring.release(slot)
    assert ring.acquire() is slot
    ring.close()


def test_slots_are_whole_pages(no_leaks):
    ring = StagingRing(CpuCopyEngine(), slot_bytes=16, slots=2)
    slots = [ring.acquire(), ring.acquire()]
    assert ring.slot_bytes == 4096
    assert [slot.buffer.data_ptr() % 4096 for slot in slots] == [0, 0]
    assert slots[1].buffer.data_ptr() - slots[0].buffer.data_ptr() == 4096
    for slot in slots:
        ring.release(slot)
    ring.close()


def test_launch_copies_from_an_offset_in_the_slot(no_leaks):
    ring = StagingRing(CpuCopyEngine(), slot_bytes=4096, slots=1)
    slot = ring.acquire()
    slot.view[100:104] = bytes([1, 2, 3, 4])
    destination = torch.zeros(4, dtype=torch.uint8)
    ring.wait(ring.launch(slot, 4, destination, start=100))
    ring.close()
    assert destination.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "nbytes, start, message",
    [
        (4097, 0, r"copy of 4097 bytes from byte 0 of a 4096-byte slot into 4097 x 1 bytes"),
        (100, 4000, r"copy of 100 bytes from byte 4000 of a 4096-byte slot"),
        (0, 0, r"copy of 0 bytes"),
    ],
)
def test_launch_checks_sizes(nbytes, start, message, no_leaks):
    ring = StagingRing(CpuCopyEngine(), slot_bytes=4096, slots=1)
    slot = ring.acquire()
    with pytest.raises(ValueError, match=message):
        ring.launch(slot, nbytes, torch.zeros(nbytes, dtype=torch.uint8), start=start)
    ring.release(slot)
    ring.close()


def test_a_copy_error_seen_through_wait_is_not_raised_again_by_close(no_leaks):
    engine = DelayedCheckingEngine(seed=3, fail_at=1)
    ring = StagingRing(engine, slot_bytes=16, slots=1)
    handle = ring.launch(ring.acquire(), 16, torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(OSError, match="copy 1 failed"):
        ring.wait(handle)
    with pytest.raises(OSError, match="copy 1 failed"):
        ring.acquire()  # the ring failed with it
    ring.close()


def _acquire_error(ring: StagingRing) -> BaseException | None:
    try:
        ring.acquire()
    except BaseException as error:  # noqa: BLE001 - returns whatever acquire raised, for the caller to assert on
        return error
    return None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed", range(3))
def test_the_cuda_engine_lands_every_byte(seed, no_leaks):
    from weightstream.memory.cuda import CudaCopyEngine

    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (20_000_000 + seed * 7919,), dtype=torch.uint8, generator=generator)
    destination = torch.zeros(data.numel(), dtype=torch.uint8, device="cuda")
    ring = StagingRing(CudaCopyEngine(torch.device("cuda", 0)), slot_bytes=1 << 20, slots=3, pinned=True)
    errors = run_readers(ring, data, destination, chunk=(1 << 20) - seed * 4099, readers=6, seed=seed)
    ring.close()
    assert errors == []
    assert torch.equal(destination.cpu(), data)


def test_direct_copies_land_beside_slot_copies_and_hold_no_slot(no_leaks):
    ring = StagingRing(CpuCopyEngine(), slot_bytes=16, slots=1)
    destination = torch.zeros(48, dtype=torch.uint8)
    handles = [
        ring.launch_direct(torch.full((16,), n, dtype=torch.uint8), destination[n * 16 : n * 16 + 16]) for n in (1, 2)
    ]
    slot = ring.acquire()  # the one slot is still free: direct copies take none
    slot.buffer.fill_(3)
    handles.append(ring.launch(slot, 16, destination[:16]))
    for handle in handles:
        ring.wait(handle)
    ring.close()
    assert destination.tolist() == [3] * 16 + [1] * 16 + [2] * 16


def test_a_failed_direct_copy_fails_the_ring(no_leaks):
    engine = DelayedCheckingEngine(seed=3, fail_at=1)
    ring = StagingRing(engine, slot_bytes=16, slots=1)
    ring.launch_direct(torch.ones(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(OSError, match="copy 1 failed"):
        ring.close()
    checked = StagingRing(CpuCopyEngine(), slot_bytes=16, slots=1)
    with pytest.raises(ValueError, match=r"copy of 8 bytes into 16"):
        checked.launch_direct(torch.ones(8, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8))
    checked.close()
