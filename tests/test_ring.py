"""The staging ring under stress, with the CPU copy engine and random delays in every stage."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from weightstream.memory.ring import CpuCopyEngine, RingClosedError, StagingRing


class DelayedCheckingEngine(CpuCopyEngine):
    """The real CPU engine, with random delays before each copy, checking that nobody wrote into
    a slot between the launch of its copy and the copy itself (a slot reused too early)."""

    def __init__(self, seed: int, fail_at: int | None = None) -> None:
        super().__init__(threads=2)
        self.random = random.Random(seed)
        self.fail_at = fail_at
        self.launched = 0
        self.violations: list[str] = []
        self.count_lock = threading.Lock()

    def launch(self, source, destination):
        with self.count_lock:
            self.launched += 1
            number = self.launched
            delay = self.random.random() * 0.004
        return super().launch((source, source.clone(), number, delay), destination)

    def _copy(self, staged, destination):
        source, snapshot, number, delay = staged
        time.sleep(delay)
        if number == self.fail_at:
            raise OSError(5, f"copy {number} failed")
        if not torch.equal(source, snapshot):
            self.violations.append(f"copy {number}: its slot was overwritten before the copy ran")
        destination.copy_(source)


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
            except BaseException as error:
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


def test_launch_checks_sizes(no_leaks):
    ring = StagingRing(CpuCopyEngine(), slot_bytes=16, slots=1)
    slot = ring.acquire()
    with pytest.raises(ValueError, match=r"copy of 32 bytes from a 16-byte slot"):
        ring.launch(slot, 32, torch.zeros(32, dtype=torch.uint8))
    ring.release(slot)
    ring.close()


def _acquire_error(ring: StagingRing) -> BaseException | None:
    try:
        ring.acquire()
    except BaseException as error:
        return error
    return None
