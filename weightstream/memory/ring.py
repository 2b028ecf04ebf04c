"""A ring of staging slots with a pluggable copy engine.

Readers fill a slot, launch an asynchronous copy from it to the destination, and take the
next free slot; a slot comes back only once its copy has finished. The same ring runs with
the CPU copy engine (threads) everywhere and, on a GPU, with a CUDA engine (pinned slots,
``cudaMemcpyAsync`` on a dedicated stream, events), so its scheduling is tested in CI.

The first failing copy fails the ring: every later ``acquire`` raises it, and ``close``
raises it once more if nobody has seen it yet.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from weightstream.errors import WeightstreamError
from weightstream.memory.host import HostArena
from weightstream.planning.plan import round_up_to_page


class RingClosedError(WeightstreamError, RuntimeError):
    """The staging ring was closed (or failed) while a reader still wanted a slot."""


class CopyHandle(Protocol):
    """One launched copy."""

    def wait(self) -> None:
        """Block until the copy has finished; raise its error if it failed."""


class CopyEngine(Protocol):
    """Copies staged bytes to their destination, asynchronously."""

    def launch(self, source: torch.Tensor, destination: torch.Tensor) -> CopyHandle:
        """Start copying ``source`` into ``destination`` (same number of bytes)."""

    def close(self) -> None:
        """Finish launched copies and release the engine's resources."""


class CpuCopyEngine:
    """Copies on a small thread pool; the engine used without CUDA (and to test the ring).

    Example:
        >>> engine = CpuCopyEngine()
        >>> destination = torch.zeros(4, dtype=torch.uint8)
        >>> engine.launch(torch.ones(4, dtype=torch.uint8), destination).wait()
        >>> engine.close(); destination.tolist()
        [1, 1, 1, 1]
    """

    def __init__(self, threads: int = 1) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weightstream-copy")

    def launch(self, source: torch.Tensor, destination: torch.Tensor) -> CpuCopy:
        return CpuCopy(self._pool.submit(self._copy, source, destination))

    def _copy(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        destination.copy_(source)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CpuCopy:
    """A copy running on the CPU engine's pool."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()


class CpuStaging:
    """Staging to CPU memory with the CPU engine: the staged reader as CI runs it."""

    pinned = False
    device = torch.device("cpu")

    def __init__(self, engine: Callable[[], CopyEngine] = CpuCopyEngine) -> None:
        self._engine = engine

    def engine(self) -> CopyEngine:
        return self._engine()

    def allocate(self, nbytes: int, file: str) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class Slot:
    """One staging buffer of the ring, as a tensor (for copies) and a memoryview (for reads)."""

    def __init__(self, number: int, buffer: torch.Tensor, view: memoryview) -> None:
        self.number = number
        self.buffer = buffer
        """``slot_bytes`` of uint8, page-aligned (pinned host memory for the CUDA engine)."""
        self.view = view
        """The same bytes, writable, for ``preadv``."""


class StagingRing:
    """``slots`` staging buffers of ``slot_bytes`` each, recycled as their copies finish.

    Example:
        >>> ring = StagingRing(CpuCopyEngine(), slot_bytes=8, slots=2)
        >>> destination = torch.zeros(8, dtype=torch.uint8)
        >>> slot = ring.acquire()
        >>> slot.buffer.fill_(3)[:1].tolist()
        [3]
        >>> ring.wait(ring.launch(slot, 8, destination))
        >>> ring.close(); destination.sum().item()
        24
    """

    def __init__(self, engine: CopyEngine, slot_bytes: int, slots: int, *, pinned: bool = False) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs at least one slot of at least one byte, got {slots} x {slot_bytes}")
        self.engine = engine
        self.slot_bytes = slot_bytes = round_up_to_page(slot_bytes)
        try:
            self._memory = HostArena(slots * slot_bytes, huge_pages=False, pinned=pinned)
        except BaseException:
            engine.close()
            raise
        self._slots = [
            Slot(
                number,
                self._memory.bytes[number * slot_bytes : (number + 1) * slot_bytes],
                self._memory.view[number * slot_bytes : (number + 1) * slot_bytes],
            )
            for number in range(slots)
        ]
        self._free = collections.deque(self._slots)
        self._in_flight: collections.deque[tuple[Slot | None, CopyHandle]] = collections.deque()
        """Launched copies in order, with the slot each frees (None for :meth:`launch_direct`'s)."""
        self._lock = threading.Condition()
        self._error: BaseException | None = None
        self._error_seen = False
        self._closed = False
        self._recycler = threading.Thread(target=self._recycle, name="weightstream-ring-recycler", daemon=True)
        self._recycler.start()

    def acquire(self) -> Slot:
        """A free slot, waiting for a copy to finish if all are in flight.

        Raises:
            The first copy error, if a copy failed; RingClosedError after ``close``.
        """
        with self._lock:
            while not self._free and self._error is None and not self._closed:
                self._lock.wait()
            self._raise_if_failed()
            return self._free.popleft()

    def launch(self, slot: Slot, nbytes: int, destination: torch.Tensor, start: int = 0) -> CopyHandle:
        """Copy ``nbytes`` of ``slot`` from ``start`` into ``destination``; the slot returns when done."""
        if (
            not (0 < nbytes and 0 <= start and start + nbytes <= self.slot_bytes)
            or destination.numel() * destination.element_size() != nbytes
        ):
            raise ValueError(
                f"copy of {nbytes} bytes from byte {start} of a {self.slot_bytes}-byte slot "
                f"into {destination.numel()} x {destination.element_size()} bytes"
            )
        with self._lock:
            self._raise_if_failed()
            handle = self.engine.launch(slot.buffer[start : start + nbytes], destination)
            self._in_flight.append((slot, handle))
            self._lock.notify_all()
        return handle

    def launch_direct(self, source: torch.Tensor, destination: torch.Tensor) -> CopyHandle:
        """Copy ``source``, memory the engine reads directly (page-locked host memory, or device memory), into
        ``destination`` without a slot, in order with the slots' copies, failing the ring as they do."""
        if source.numel() * source.element_size() != destination.numel() * destination.element_size():
            raise ValueError(
                f"copy of {source.numel() * source.element_size()} bytes into "
                f"{destination.numel() * destination.element_size()}"
            )
        with self._lock:
            self._raise_if_failed()
            handle = self.engine.launch(source, destination)
            self._in_flight.append((None, handle))
            self._lock.notify_all()
        return handle

    def wait(self, handle: CopyHandle) -> None:
        """Wait for one launched copy; its failure is the ring's failure, raised here (and not again by ``close``)."""
        try:
            handle.wait()
        except BaseException as error:
            with self._lock:
                if self._error is None:
                    self._error = error
                self._error_seen = True
            raise

    def release(self, slot: Slot) -> None:
        """Give back a slot that will not be launched (a reader stopping early)."""
        with self._lock:
            self._free.append(slot)
            self._lock.notify_all()

    def close(self) -> None:
        """Wait for every launched copy, stop the recycler and the engine; raise an unseen copy error."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._recycler.join()
        self.engine.close()
        with self._lock:
            if self._error is not None and not self._error_seen:
                self._error_seen = True
                raise self._error

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            self._error_seen = True
            raise self._error
        if self._closed:
            raise RingClosedError("the staging ring is closed")

    def _recycle(self) -> None:
        """Wait for copies in launch order and hand their slots back."""
        while True:
            with self._lock:
                while not self._in_flight and not self._closed:
                    self._lock.wait()
                if not self._in_flight:
                    return
                slot, handle = self._in_flight[0]
            try:
                handle.wait()
            except BaseException as error:  # noqa: BLE001 - any copy failure fails the ring
                with self._lock:
                    if self._error is None:
                        self._error = error
            with self._lock:
                self._in_flight.popleft()
                if slot is not None:
                    self._free.append(slot)
                self._lock.notify_all()
