"""Where a CUDA load through the node cache copies each file from, with no staging slot.

First choice, the daemon's own copy on this GPU (``cache serve --device``): imported and mapped read-only
(``weightstream.nodecache.vmm``), so bytes move device to device, or not at all for ``zero_copy=True``. Else
the segment in host shared memory, mapped read-only and page-locked in place
(``weightstream.nodecache.shared_mapping``), so the copy engine's DMA reads it directly. A device whose driver cannot
lock read-only memory gets neither: its copies go through the staging ring, and the log says so once.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping

import torch

from weightstream.errors import CacheError, DeviceMemoryError, DeviceUnavailableError, logger
from weightstream.memory import pinning
from weightstream.nodecache import vmm
from weightstream.nodecache.client import CachedStore, SegmentSource
from weightstream.nodecache.shared_mapping import map_read_only

log = logger(__name__)


class SegmentCopies:
    """The copy sources of one CUDA load's segments, on ``device`` (see the module's description).

    Example:
        >>> store = CachedStore(inner, client, None, SegmentCopies(torch.device("cuda:0")))  # doctest: +SKIP
    """

    def __init__(self, device: torch.device, *, strict: bool = False) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.strict = strict
        """``zero_copy=True``: views of the daemon's device copy or an error, never a copy from the host."""
        self.routes: collections.Counter[str] = collections.Counter()
        self.uuid = vmm.gpu_uuid(self.index)
        self.locks_read_only = pinning.read_only_supported(self.index)
        if not self.locks_read_only:
            log.info(
                "cuda:%d cannot page-lock read-only memory (cudaDevAttrHostRegisterReadOnlySupported is 0): copies "
                "from the node cache's host memory go through staging slots",
                self.index,
            )

    def __call__(
        self, store: CachedStore, segment: SegmentSource, fd: int, answer: Mapping[str, object]
    ) -> torch.Tensor | None:
        gpus = answer.get("gpus")
        if isinstance(gpus, list) and self.uuid in gpus:
            try:
                copy = self._import_device_copy(store, segment)
            except (CacheError, DeviceUnavailableError, DeviceMemoryError) as error:
                if self.strict:
                    raise
                log.warning("%s: no device copy (%s); copying from the host's shared memory", segment.uri, error)
            else:
                self.routes["device-copy"] += 1
                return copy
        if not self.locks_read_only:
            self.routes["staging-ring"] += 1
            return None
        locked = map_read_only(fd, segment.size, page_locked=True, what=segment.uri, device=self.index)
        self.routes["page-locked"] += 1
        return locked

    def _import_device_copy(self, store: CachedStore, segment: SegmentSource) -> torch.Tensor:
        """The daemon's copy of ``segment`` on this GPU, mapped read-only here.

        Raises:
            CacheError: the daemon has no room for it, or went away; DeviceUnavailableError, DeviceMemoryError: the
                driver refused to import or map it.
        """
        copy_fd, allocation_bytes = store.device_copy(segment, self.uuid)
        try:
            return vmm.import_read_only(copy_fd, segment.size, allocation_bytes, self.index, segment.uri)
        finally:
            os.close(copy_fd)
