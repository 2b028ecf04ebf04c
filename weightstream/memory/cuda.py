"""The CUDA side of the staging ring: a copy engine on a dedicated stream and device memory.

Imported only for CUDA destinations; importing it on a machine without CUDA is harmless,
using it is not (the loaders refuse such destinations before they get here).

Each copy is ``cudaMemcpyAsync`` from a pinned slot (torch's ``copy_(non_blocking=True)`` on
our stream issues exactly that) followed by an event; the ring's recycler and the reader
wait on the events, so a slot is reused, and a tensor yielded, only once its copy is done.
"""

from __future__ import annotations

import torch

from weightstream.errors import DeviceMemoryError


class CudaCopy:
    """One launched host-to-device copy, finished when its event is."""

    def __init__(self, done: torch.cuda.Event) -> None:
        self._done = done

    def wait(self) -> None:
        self._done.synchronize()


class CudaCopyEngine:
    """Copies pinned slots to device memory on one dedicated stream, in launch order.

    Example:
        >>> engine = CudaCopyEngine(torch.device("cuda:0"))  # doctest: +SKIP
        >>> engine.launch(pinned_bytes, device_bytes).wait()  # doctest: +SKIP
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device)
        # Destination memory was allocated on the current stream, maybe from blocks that work queued
        # there still uses: our copies must not overtake that work.
        self._stream.wait_stream(torch.cuda.current_stream(device))

    def follow_current_stream(self) -> None:
        """Order later copies after the work queued so far on the current stream (without blocking the host)."""
        self._stream.wait_stream(torch.cuda.current_stream(self._device))

    def launch(self, source: torch.Tensor, destination: torch.Tensor) -> CudaCopy:
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            destination.copy_(source, non_blocking=True)
            # The batch's memory was allocated on the current stream: dropped (a failed or stopped load) while this
            # copy is in flight, the caching allocator could hand it out again under the copy. Recorded on our
            # stream, it is reused only once the copy is done.
            destination.record_stream(self._stream)
            done = torch.cuda.Event()
            done.record(self._stream)
        return CudaCopy(done)

    def close(self) -> None:
        self._stream.synchronize()


class CudaStaging:
    """Destination memory on ``device``, reached through pinned slots and the CUDA engine."""

    pinned = True

    def __init__(self, device: str | torch.device) -> None:
        device = torch.device(device)
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self._engines: list[CudaCopyEngine] = []

    def engine(self) -> CudaCopyEngine:
        self._engines.append(CudaCopyEngine(self.device))
        return self._engines[-1]

    def allocate(self, nbytes: int, file: str) -> torch.Tensor:
        """Device memory, allocated on the current stream (it returns to that stream's pool when the
        caller drops it). The caching allocator may hand out a block that work queued on that stream
        still uses (a tensor the caller dropped a moment ago): the copy streams wait for that work first."""
        try:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as error:
            free, total = torch.cuda.mem_get_info(self.device)
            raise DeviceMemoryError(
                f"{file}: cannot allocate {nbytes} bytes on {self.device} for its tensors "
                f"({free} of {total} bytes free): {str(error).splitlines()[0]}"
            ) from None
        for engine in self._engines:
            engine.follow_current_stream()
        return buffer
