"""Device memory shared between processes through the CUDA virtual memory API (cuda-python's driver bindings).

The cache daemon allocates a file's device copy with ``cuMemCreate``, asking for a POSIX file descriptor
handle, fills it from the file's segment, and exports the handle (``cuMemExportToShareableHandle``): a
descriptor that travels over the cache's Unix socket like a segment's. A client imports it
(``cuMemImportFromShareableHandle``), reserves an address range, maps the allocation there and makes it
readable by its device only (``CU_MEM_ACCESS_FLAGS_PROT_READ``: no client can write the shared bytes). The
physical memory lives while any process holds a handle or a mapping of it, so clients keep their tensors
when the daemon dies: unlike the legacy ``cudaIpcGetMemHandle``, whose memory dies with its exporter.
Devices are named by UUID (``GPU-...``), the same in every process whatever its ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType

import torch

from weightstream.errors import (
    CacheFullError,
    DeviceMemoryError,
    DeviceUnavailableError,
    MemoryStillInUseError,
    logger,
)
from weightstream.memory.pinning import INSTALL_HINT
from weightstream.nodecache.dlpack import tensor_at

log = logger(__name__)

CAPTURE_POLL_S = 0.05
"""How often the unmapper looks whether a stream it waits for still captures a graph."""
COMPRESSION_NONE = 0
"""``CU_MEM_ALLOCATION_COMP_NONE`` (cuda.h defines it; cuda-python has no name for it): compressible memory cannot
be handed to a NIC."""
KEPT_OUT_OF_USE: list[tuple[object, int, int]] = []
"""Allocations (handle, address, bytes) a transfer that could not be stopped may still write into: mapped and held
for the life of the process, never reused."""


@functools.cache
def driver() -> ModuleType:
    """cuda-python's driver bindings, initialised (``cuInit``).

    Raises:
        DeviceUnavailableError: cuda-python is missing, or no usable driver.
    """
    try:
        from cuda.bindings import driver as bindings
    except ImportError as error:
        raise DeviceUnavailableError(f"device memory sharing needs cuda-python ({error}); {INSTALL_HINT}") from None
    try:
        (status,) = bindings.cuInit(0)
    except Exception as error:  # noqa: BLE001 - without a driver library cuda-python raises its own loader error
        raise DeviceUnavailableError(f"the CUDA driver cannot be loaded: {error}") from None
    if status != bindings.CUresult.CUDA_SUCCESS:
        raise DeviceUnavailableError(f"cuInit failed: {_describe(bindings, status)}")
    return bindings


def check(status: object, call: str, error: type[Exception] = DeviceUnavailableError) -> None:
    """Raise ``error`` naming ``call`` unless ``status`` is ``CUDA_SUCCESS``."""
    bindings = driver()
    if status != bindings.CUresult.CUDA_SUCCESS:
        raise error(f"{call} failed: {_describe(bindings, status)}")


def gpu_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` (as this process numbers its devices), as ``nvidia-smi -L`` prints it.

    Example:
        >>> gpu_uuid(0)  # doctest: +SKIP
        'GPU-5f1c3a9e-0b6d-2c4e-9a7f-1e2d3c4b5a69'
    """
    bindings = driver()
    status, device = bindings.cuDeviceGet(index)
    check(status, f"cuDeviceGet({index})")
    # A MIG instance's own UUID, not its GPU's (instances of one GPU must not share a key): cuDeviceGetUuid_v2 in
    # CUDA 12, cuDeviceGetUuid itself in CUDA 13 (where _v2 is gone).
    get_uuid = getattr(bindings, "cuDeviceGetUuid_v2", bindings.cuDeviceGetUuid)
    status, uuid = get_uuid(device)
    check(status, f"cuDeviceGetUuid({index})")
    text = bytes(uuid.bytes).hex()
    return f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:32]}"


@contextlib.contextmanager
def on_device(index: int) -> Iterator[None]:
    """Device ``index``'s primary context (torch's) current on this thread for the block, the caller's current
    context back after it: the driver calls need one, and a caller on another GPU must not find its device changed.

    Example:
        >>> with on_device(1):  # doctest: +SKIP
        ...     address = ExportedCopy(nbytes, 1, "model.safetensors", write).map_read_only()
    """
    bindings = driver()
    (status,) = bindings.cuCtxPushCurrent(_primary_context(index))
    check(status, f"cuCtxPushCurrent(device {index})")
    try:
        yield
    finally:
        status, _ = bindings.cuCtxPopCurrent()
        if status != bindings.CUresult.CUDA_SUCCESS:
            log.warning("cuCtxPopCurrent after a call on device %d failed: %s", index, _describe(bindings, status))


@functools.cache
def _primary_context(index: int) -> object:
    """Device ``index``'s primary context, retained once for the life of the process."""
    bindings = driver()
    status, device = bindings.cuDeviceGet(index)
    check(status, f"cuDeviceGet({index})")
    status, context = bindings.cuDevicePrimaryCtxRetain(device)
    check(status, f"cuDevicePrimaryCtxRetain({index})")
    return context


def _properties(index: int) -> object:
    """How a copy on device ``index`` is allocated: pinned device memory exportable as a file descriptor, never
    compressed, and usable by a NIC (GPUDirect RDMA) where the device supports it with VMM allocations: the fleet
    offers these copies to peers' NICs through NIXL, and memory without the flag cannot be registered for RDMA (NCCL
    and Mooncake set it the same way)."""
    bindings = driver()
    prop = bindings.CUmemAllocationProp()
    prop.type = bindings.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = bindings.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = index
    prop.requestedHandleTypes = bindings.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.allocFlags.compressionType = COMPRESSION_NONE
    prop.allocFlags.gpuDirectRDMACapable = 1 if _rdma_capable(index) else 0
    return prop


@functools.cache
def _rdma_capable(index: int) -> bool:
    """Whether device ``index`` supports GPUDirect RDMA on VMM allocations."""
    bindings = driver()
    attribute = bindings.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
    status, device = bindings.cuDeviceGet(index)
    check(status, f"cuDeviceGet({index})")
    status, supported = bindings.cuDeviceGetAttribute(attribute, device)
    check(status, "cuDeviceGetAttribute(GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)")
    return bool(supported)


def allocation_bytes(nbytes: int, index: int) -> int:
    """``nbytes`` rounded up to the allocation granularity of device ``index`` (2 MiB on current GPUs)."""
    bindings = driver()
    flag = bindings.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    status, granularity = bindings.cuMemGetAllocationGranularity(_properties(index), flag)
    check(status, "cuMemGetAllocationGranularity")
    return -(-nbytes // granularity) * granularity


class ExportedCopy:
    """A new allocation of ``nbytes`` on device ``index``, filled by ``write(address)`` (the allocation mapped
    writable at ``address`` for the call: :func:`host_writer` copies host memory there, the fleet reads a peer's copy
    into it) and exported as a POSIX file descriptor (:attr:`fd`). The daemon keeps one per cached file and GPU;
    :meth:`release` drops its handle and descriptor (importers keep the memory until they unmap it).

    Raises:
        CacheFullError: the device has no room for it.
        DeviceUnavailableError: the driver refused a call.
        Whatever ``write`` raises (the allocation is released first).

    Example:
        >>> write = host_writer(segment_address, 1 << 30, "model.safetensors")  # doctest: +SKIP
        >>> copy = ExportedCopy(1 << 30, 0, "model.safetensors", write)  # doctest: +SKIP
        >>> socket.send_fds(connection, [answer], [copy.fd])  # doctest: +SKIP
    """

    def __init__(self, nbytes: int, index: int, what: str, write: Callable[[int], None]) -> None:
        bindings = driver()
        self.nbytes, self.index = nbytes, index
        with on_device(index):
            self.allocation_bytes = allocation_bytes(nbytes, index)
            status, self._handle = bindings.cuMemCreate(self.allocation_bytes, _properties(index), 0)
            if status == bindings.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise CacheFullError(
                    f"{what}: no room for a {self.allocation_bytes}-byte copy on device {index}: "
                    f"{_describe(bindings, status)}"
                )
            check(status, f"cuMemCreate({self.allocation_bytes}) for {what}")
            kept = False
            try:
                address = map_allocation(self._handle, self.allocation_bytes, index, writable=True)
                try:
                    write(address)
                except MemoryStillInUseError:
                    kept = True  # a transfer that could not be stopped may still write it: never unmapped nor freed
                    KEPT_OUT_OF_USE.append((self._handle, address, self.allocation_bytes))
                    raise
                finally:
                    if not kept:
                        unmap_allocation(address, self.allocation_bytes)
                handle_type = bindings.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                status, fd = bindings.cuMemExportToShareableHandle(self._handle, handle_type, 0)
                check(status, f"cuMemExportToShareableHandle for {what}")
                self.fd = int(fd)
            except BaseException:
                if not kept:
                    _logged(bindings.cuMemRelease(self._handle), f"cuMemRelease of {what}'s copy")
                raise

    def map_read_only(self) -> int:
        """The allocation mapped read-only in this process (for the fleet's peers to read through NIXL); its address,
        to be unmapped with :func:`unmap_allocation` (``allocation_bytes``) on this device."""
        with on_device(self.index):
            return map_allocation(self._handle, self.allocation_bytes, self.index, writable=False)

    def release(self) -> None:
        """Close the descriptor and release the daemon's handle (a failure is logged: nothing can be done then)."""
        os.close(self.fd)
        with on_device(self.index):
            _logged(driver().cuMemRelease(self._handle), f"cuMemRelease of a {self.allocation_bytes}-byte copy")


def host_writer(host_address: int, nbytes: int, what: str) -> Callable[[int], None]:
    """A ``write`` for :class:`ExportedCopy` that copies ``nbytes`` of host memory at ``host_address`` (``what``'s
    bytes) to the device."""

    def write(address: int) -> None:
        (status,) = driver().cuMemcpyHtoD(address, host_address, nbytes)
        check(status, f"cuMemcpyHtoD of {nbytes} bytes of {what}")

    return write


def copy_to_host(address: int, host_address: int, nbytes: int) -> None:
    """Copy ``nbytes`` of device memory at ``address`` to host memory at ``host_address`` (in the current context).

    Raises:
        DeviceMemoryError: the driver refused the copy.
    """
    (status,) = driver().cuMemcpyDtoH(host_address, address, nbytes)
    check(status, f"cuMemcpyDtoH of {nbytes} bytes", DeviceMemoryError)


def map_allocation(handle: object, nbytes: int, index: int, *, writable: bool) -> int:
    """Reserve ``nbytes`` of address space, map ``handle``'s allocation there, give device ``index`` access (read and
    write, or read only); its address."""
    bindings = driver()
    status, address = bindings.cuMemAddressReserve(nbytes, 0, 0, 0)
    check(status, f"cuMemAddressReserve({nbytes})", DeviceMemoryError)
    try:
        (status,) = bindings.cuMemMap(address, nbytes, 0, handle, 0)
        check(status, "cuMemMap", DeviceMemoryError)
        access = bindings.CUmemAccessDesc()
        access.location.type = bindings.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        flags = bindings.CUmemAccess_flags
        access.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable else flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        (status,) = bindings.cuMemSetAccess(address, nbytes, [access], 1)
        check(status, "cuMemSetAccess", DeviceMemoryError)
    except BaseException:
        unmap_allocation(int(address), nbytes)
        raise
    return int(address)


def unmap_allocation(address: int, nbytes: int) -> None:
    """Undo :func:`map_allocation` (the allocation is freed once no process maps or holds it); failures are logged."""
    bindings = driver()
    _logged(bindings.cuMemUnmap(address, nbytes), f"cuMemUnmap({address:#x}, {nbytes})")
    _logged(bindings.cuMemAddressFree(address, nbytes), f"cuMemAddressFree({address:#x}, {nbytes})")


def _logged(result: object, call: str) -> None:
    """Log ``call``'s failure (a release or unmap, whose caller cannot act on it)."""
    bindings = driver()
    status = result[0] if isinstance(result, tuple) else result
    if status != bindings.CUresult.CUDA_SUCCESS:
        log.warning("%s failed: %s", call, _describe(bindings, status))


class Unmapper:
    """Unmaps imported allocations on a thread of its own, after the device has finished with them: torch frees a
    tensor's memory as its last reference dies, while kernels queued before may still read it (torch's allocator
    waits on streams; a foreign allocation gets no such care). The thread that drops the last view may be capturing
    a CUDA graph, which engines do right after loading, and another thread of the process may be capturing on the
    same GPU: a context or device synchronisation invalidates every capture on the device, whatever its mode. So the
    drop only queues the unmap with the stream current where the view died (as torch's allocator, the stream whose
    work counts; a view used on other streams is the user's to synchronise, as for any torch tensor), and this
    thread, in relaxed capture mode, waits for that stream alone: once the stream is not capturing, an event is
    recorded on it and waited for, then the allocation is unmapped. Nothing here ever synchronises a context."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, int, int, int]] = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()

    def unmap_later(self, address: int, allocation_bytes: int, index: int, stream: int) -> None:
        """Queue the unmap of ``allocation_bytes`` at ``address`` on device ``index`` once the work queued on
        ``stream`` (a ``CUstream`` handle: the stream current where the last view died) is done (from any thread)."""
        with self._lock:
            if not self._started:
                threading.Thread(target=self._run, name="weightstream-vmm-unmap", daemon=True).start()
                self._started = True
        self._queue.put((address, allocation_bytes, index, stream))

    def _run(self) -> None:
        bindings = driver()
        relaxed = bindings.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        _logged(bindings.cuThreadExchangeStreamCaptureMode(relaxed), "cuThreadExchangeStreamCaptureMode")
        while True:
            address, allocation_bytes, index, stream = self._queue.get()
            try:
                with on_device(index):
                    _wait_for_stream(bindings, bindings.CUstream(stream), f"unmapping {address:#x}")
                    unmap_allocation(address, allocation_bytes)
            except Exception as error:  # noqa: BLE001 - this thread must outlive one failure; it is said
                log.warning(
                    "unmapping %d bytes at %#x on device %d failed: %s", allocation_bytes, address, index, error
                )


def _wait_for_stream(bindings: ModuleType, stream: object, why: str) -> None:
    """Wait for the work queued on ``stream`` so far without synchronising its context: while it is capturing (its
    work is not work yet), look again every ``CAPTURE_POLL_S``; then record an event on it and wait for the event
    (legal while other threads capture). A failure is logged, and the wait ends (the unmap goes on)."""
    none = bindings.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
    while True:
        status, capturing = bindings.cuStreamIsCapturing(stream)
        if status != bindings.CUresult.CUDA_SUCCESS:
            _logged(status, f"cuStreamIsCapturing before {why}")
            return
        if capturing == none:
            break
        time.sleep(CAPTURE_POLL_S)
    status, event = bindings.cuEventCreate(bindings.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    if status != bindings.CUresult.CUDA_SUCCESS:
        _logged(status, f"cuEventCreate before {why}")
        return
    try:
        (status,) = bindings.cuEventRecord(event, stream)
        if status == bindings.CUresult.CUDA_SUCCESS:
            (status,) = bindings.cuEventSynchronize(event)
        _logged(status, f"waiting for the stream's work before {why}")
    finally:
        _logged(bindings.cuEventDestroy(event), f"cuEventDestroy before {why}")


_unmapper = Unmapper()


_import_lock = threading.Lock()


def import_read_only(fd: int, nbytes: int, allocation_bytes: int, index: int, what: str) -> torch.Tensor:
    """The allocation exported as ``fd`` (``allocation_bytes``, of which ``nbytes`` hold the file), mapped read-only
    on device ``index``: a uint8 tensor of ``nbytes`` there, valid whatever happens to the exporter. ``fd`` stays
    the caller's to close.

    Raises:
        DeviceUnavailableError, DeviceMemoryError: the driver refused to import or map it.

    Example:
        >>> weights = import_read_only(fd, 1 << 30, 1 << 30, 0, "model.safetensors")  # doctest: +SKIP
    """
    bindings = driver()
    with _import_lock, on_device(index):
        handle_type = bindings.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        status, handle = bindings.cuMemImportFromShareableHandle(fd, handle_type)
        check(status, f"cuMemImportFromShareableHandle for {what}")
        try:
            address = map_allocation(handle, allocation_bytes, index, writable=False)
        finally:
            _logged(bindings.cuMemRelease(handle), f"cuMemRelease of {what}'s imported handle")  # the mapping holds it

    def unmap_later() -> None:
        stream = torch.cuda.current_stream(index).cuda_stream  # where the last view died: its work counts
        _unmapper.unmap_later(address, allocation_bytes, index, stream)

    view = tensor_at(address, nbytes, torch.device("cuda", index), unmap_later)
    if view.data_ptr() != address:  # a copy would be memory of torch's, not the daemon's copy
        raise DeviceMemoryError(f"{what}: the imported copy at {address:#x} came back at {view.data_ptr():#x}")
    return view


def _describe(bindings: ModuleType, status: object) -> str:
    _, name = bindings.cuGetErrorName(status)
    _, text = bindings.cuGetErrorString(status)
    return f"{name.decode() if name else status} ({text.decode() if text else 'no description'})"
