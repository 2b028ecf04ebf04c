"""The GPUDirect Storage reader: cuFile reads each request from the file straight into the
device buffer of its file, with no host memory in between.

Same contract as the other readers: one device buffer per file allocated up front, tensors
yielded as their last read completes (cuFileRead returns once the bytes are on the device),
the first failure stops the rest, and cuFile handles, registrations, descriptors and threads
are all released on every exit.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from types import ModuleType

import torch

from weightstream.errors import SourceError, TruncatedFileError
from weightstream.memory import gds
from weightstream.memory.cuda import CudaStaging
from weightstream.memory.devices import check_fits
from weightstream.options import LoadOptions
from weightstream.planning.plan import LoadPlan, ReadRequest, layout_file
from weightstream.readers.tasks import (
    THREAD_NAME_PREFIX,
    buffer_tensor,
    start_readers,
    tensors_as_read,
)
from weightstream.sources.base import DirectIO


def read_gds(
    store: DirectIO, plan: LoadPlan, opts: LoadOptions, device: CudaStaging
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of ``plan`` on ``device``, read with cuFile from ``store``'s files.

    Example:
        >>> opts = LoadOptions(device="cuda", gds=True)
        >>> for name, tensor in read_gds(LocalStore(), plan, opts, CudaStaging("cuda")):  # doctest: +SKIP
        ...     model[name].copy_(tensor)
    """
    check_fits(plan.total_bytes, opts.device, plan.uri)
    layouts = [layout_file(plan.tensors_of(spec.path), opts.request_bytes(plan.uri)) for spec in plan.files]
    layouts = [layout for layout in layouts if layout.tensor_offsets]
    specs = {spec.path: spec for spec in plan.files}
    with contextlib.ExitStack() as cleanup:
        cufile = cleanup.enter_context(gds.driver())
        destinations = [device.allocate(layout.buffer_bytes, layout.file) for layout in layouts]
        cleanup.callback(destinations.clear)
        # cuFile's DMA runs outside every stream: work queued on the current stream that still uses these blocks
        # (the caching allocator hands out memory freed a moment ago) must finish before it overwrites them.
        torch.cuda.current_stream(device.device).synchronize()
        addresses = [cleanup.enter_context(gds.registered_buffer(cufile, buffer)) for buffer in destinations]
        handles = [
            cleanup.enter_context(
                gds.registered_file(
                    cufile, store.direct_path(layout.file), specs[layout.file].size, specs[layout.file].version
                )
            )
            for layout in layouts
        ]
        readers, stop, futures = start_readers(
            cleanup, opts, THREAD_NAME_PREFIX + "-gds", lambda: torch.cuda.set_device(device.device)
        )
        for file_number, layout in enumerate(layouts):
            for request_number, request in enumerate(layout.requests):
                task = readers.submit(
                    _read, cufile, layout.file, handles[file_number], addresses[file_number], request, stop, opts
                )
                futures[task] = (file_number, request_number)
        yield from tensors_as_read(
            layouts, futures, lambda file, tensor: buffer_tensor(layouts[file], destinations[file], tensor)
        )


def _read(
    cufile: ModuleType,
    path: str,
    handle: int,
    address: int,
    request: ReadRequest,
    stop: threading.Event,
    opts: LoadOptions,
) -> None:
    if stop.is_set():
        return
    done = 0
    span = f"{path}: cuFileRead of bytes {request.offset}..{request.offset + request.nbytes}"
    while done < request.nbytes:
        try:
            got = cufile.read(handle, address, request.nbytes - done, request.offset + done, request.dest_offset + done)
        except cufile.cuFileError as error:
            raise SourceError(f"{span} failed at byte {request.offset + done}: {error}") from None
        except ValueError as error:
            raise _os_error(error, f"{span} failed at byte {request.offset + done}") from None
        if got < 0:  # -1 (errno) raises above; other negative values are cuFile's own error codes
            raise SourceError(f"{span} failed at byte {request.offset + done}: cuFile error {_op_error(cufile, -got)}")
        if got == 0:
            raise TruncatedFileError(
                f"{span}: file ends at byte {request.offset + done} (it changed or shrank while loading)"
            )
        done += got
    if opts.progress is not None:
        opts.progress(request.nbytes)


def _op_error(cufile: ModuleType, code: int) -> str:
    known = {error.value: error.name for error in cufile.OpError}
    return f"{code} ({known[code]})" if code in known else str(code)


_NOT_AN_OP_ERROR = re.compile(r"^(-?\d+) is not a valid OpError$")


def _os_error(error: ValueError, what: str) -> Exception:
    """The error a failed ``cufile.read`` meant: cuda-bindings (12.9, 13.5) turns a read that failed with ``errno``
    into ``cuFileError(errno)``, whose ``OpError(errno)`` raises ``ValueError: 5 is not a valid OpError``: a
    :class:`SourceError` with that errno. Any other ``ValueError`` is returned as it is (a bug, not the disk's).

    Example:
        >>> failure = _os_error(ValueError("5 is not a valid OpError"), "m.safetensors: cuFileRead")
        >>> type(failure).__name__, failure.errno, str(failure)
        ('SourceError', 5, 'm.safetensors: cuFileRead: Input/output error (errno 5)')
    """
    match = _NOT_AN_OP_ERROR.match(str(error))
    if match is None:
        return error
    number = int(match.group(1))
    failure = SourceError(f"{what}: {os.strerror(number)} (errno {number})")
    failure.errno = number
    return failure
