"""The node weight cache as a source: files read from the daemon's shared-memory segments.

:class:`CachedStore` wraps the store of the checkpoint's own source (local, S3, GCS, HTTP, Hub): it
lists and names files through it, and opens every file by asking the daemon to attach it (the daemon
fills the segment from the source on a miss, once, however many clients ask). The answer carries the
segment's descriptor; the client maps it privately (copy-on-write: writing a tensor never reaches the
shared bytes, which are a read-only file), checks its size and the checksum of its first bytes against
the answer, and closes the descriptor. Every loader reads through it unchanged; the safetensors and
sharded-state loaders hand out views of the mapping (``zero_copy``), so a process attaching a cached
checkpoint gets no fresh pages at all.

For a CUDA destination each segment also gets a :attr:`SegmentSource.copy_source`, memory a copy engine
reads straight from: the daemon's copy on this GPU (``cache serve --device``), imported and mapped
read-only, when the daemon keeps one; else the segment itself mapped shared and read-only and
page-locked in place (``cudaHostRegisterReadOnly``), so copies to the device need no staging slot.

The daemon is found at a socket: ``cache=PATH``, or ``cache="auto"`` = ``$WEIGHTSTREAM_CACHE`` or
:func:`default_socket`, used when a daemon listens there (else the load reads its source, and says so
once in the log).
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
from collections.abc import Mapping
from typing import Protocol

import torch

from weightstream.errors import (
    CacheProtocolError,
    DeviceUnavailableError,
    SourceChangedError,
    TruncatedFileError,
    logger,
)
from weightstream.nodecache.connection import CacheClient
from weightstream.nodecache.protocol import HEAD_BYTES, close_all, head_digest
from weightstream.sources.base import Source, Store
from weightstream.sources.http.store import HttpStore

log = logger(__name__)


class CopySources(Protocol):
    """Gives each segment of a CUDA load its :attr:`SegmentSource.copy_source`
    (``weightstream.nodecache.gpu_import``), and counts the routes it chose."""

    routes: collections.Counter[str]
    """Files by where their copies read: ``device-copy``, ``page-locked`` (host segments) or ``staging-ring``."""

    def __call__(
        self, store: CachedStore, segment: SegmentSource, fd: int, answer: Mapping[str, object]
    ) -> torch.Tensor | None:
        """What copies of ``segment`` (whose descriptor is ``fd``, attached with ``answer``) read from, or None."""


class CachedStore:
    """``inner``'s files, read from the cache daemon at ``client`` (see the module's description)."""

    def __init__(
        self,
        inner: Store,
        client: CacheClient,
        storage_options: Mapping[str, object] | None,
        copy_sources: CopySources | None = None,
    ) -> None:
        self.inner = inner
        self.client = client
        self.lists = inner.lists
        self._attached: dict[str, bool] = {}
        """Each file attached, and whether the daemon filled it for this store (else it held it already)."""
        self._copy_sources = copy_sources
        # An HTTP store (the Hub's among them) says what recreates its reads: its headers, a token for the Hub only.
        options = inner.storage_options() if isinstance(inner, HttpStore) else storage_options
        try:
            self._storage_options = json.loads(json.dumps(dict(options or {})))
        except (TypeError, ValueError) as error:
            raise CacheProtocolError(f"storage_options must be JSON to travel to the cache daemon: {error}") from error
        self._segments: dict[str, SegmentSource] = {}
        """Each file's segment, attached once per checkpoint (the plan reads its header, the reads its bytes)."""

    def is_dir(self, uri: str) -> bool:
        return self.inner.is_dir(uri)

    def exists(self, uri: str) -> bool:
        return self.inner.exists(uri)

    def list_names(self, uri: str) -> list[str]:
        return self.inner.list_names(uri)

    def join(self, directory: str, name: str) -> str:
        return self.inner.join(directory, name)

    def resolve_direct(self, uri: str, direct: bool | str) -> bool:
        return False  # shared memory: there is no page cache to go around

    def open(self, uri: str, *, direct: bool | str = False) -> Source:
        return self._attach(uri, None, None)

    def open_pinned(self, uri: str, size: int, version: str, *, direct: bool | str = False) -> Source:
        return self._attach(uri, size, version)

    def mapped(self, uri: str, size: int, version: str | None) -> SegmentSource:
        """The segment of ``uri`` at ``version``, for views of its bytes."""
        return self._attach(uri, size, version)

    def shared(self, uri: str, size: int, version: str | None) -> SegmentSource:
        """The segment of ``uri`` at ``version``: shared memory, with the daemon's device copy where it made one
        (declares :class:`~weightstream.sources.base.SharedMemory`)."""
        return self._attach(uri, size, version)

    def attached(self) -> dict[str, int]:
        """Files this store attached: ``hit`` (the daemon held them), ``filled`` (it read them for this load)."""
        filled = sum(self._attached.values())
        return {"hit": len(self._attached) - filled, "filled": filled}

    def copy_routes(self) -> dict[str, int]:
        """Files of a CUDA load by where their copies read (see :class:`CopySources`); empty for other loads."""
        return {} if self._copy_sources is None else dict(self._copy_sources.routes)

    def close(self) -> None:
        self._segments.clear()
        self.client.close()
        self.inner.close()

    def _attach(self, uri: str, size: int | None, version: str | None) -> SegmentSource:
        known = self._segments.get(uri)
        if known is not None and (size is None or (known.size, known.version) == (size, version)):
            return known
        answer, fds = self.client.attach(uri, size, version, self._storage_options)
        try:
            if len(fds) != 1:
                raise CacheProtocolError(f"{uri}: the cache daemon answered with {len(fds)} descriptors, not 1")
            segment = SegmentSource(uri, fds[0], answer)
            if self._copy_sources is not None and segment.size:
                segment.copy_source = self._copy_sources(self, segment, fds[0], answer)
        finally:
            for fd in fds:
                os.close(fd)
        if size is not None and (segment.size, segment.version) != (size, version):
            raise SourceChangedError(
                f"{uri}: the cache holds version {segment.version} ({segment.size} bytes); {version} ({size} bytes) "
                f"was planned"
            )
        self._segments[uri] = segment
        filled = answer.get("filled") is True
        self._attached[uri] = filled
        log.info("cache: %s %s the node cache at %s", uri, "filled into" if filled else "found in", self.client.path)
        return segment

    def device_copy(self, segment: SegmentSource, uuid: str) -> tuple[int, int]:
        """A descriptor of the daemon's copy of ``segment`` on GPU ``uuid`` (made on its first request; the caller
        closes it) and the copy's allocation bytes.

        Raises:
            CacheFullError: the GPU has no room for it; CacheError: the daemon keeps no copies on that GPU.
        """
        request = {"op": "device", "uri": segment.uri, "size": segment.size, "version": segment.version, "gpu": uuid}
        answer, fds = self.client.request_file({**request, "storage_options": self._storage_options})
        allocation = answer.get("allocation_bytes")
        if len(fds) != 1 or answer.get("size") != segment.size or answer.get("gpu") != uuid:
            close_all(fds)
            raise CacheProtocolError(
                f"{segment.uri}: the cache daemon's device answer does not match the request: {dict(answer)!r:.300}"
            )
        if not isinstance(allocation, int) or isinstance(allocation, bool) or allocation < segment.size:
            close_all(fds)
            raise CacheProtocolError(f"{segment.uri}: the device copy's allocation_bytes is {allocation!r}")
        return fds[0], allocation


class SegmentSource:
    """A cached file: a private mapping of its read-only segment. Reads copy from it; :attr:`bytes` views it."""

    direct = False
    copy_source: torch.Tensor | None = None
    """For a CUDA destination: the file's bytes (uint8) where a copy engine reads them directly, the daemon's copy
    on the GPU or the segment page-locked read-only; never written, never handed to a caller."""

    def __init__(self, uri: str, fd: int, answer: Mapping[str, object]) -> None:
        size, version, head = answer.get("size"), answer.get("version"), answer.get("head_sha256")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(head, str):
            raise CacheProtocolError(
                f"{uri}: the cache daemon's answer lacks a size or a checksum: {dict(answer)!r:.200}"
            )
        if version is not None and not isinstance(version, str):
            raise CacheProtocolError(f"{uri}: the cache daemon's answer has a version of type {type(version).__name__}")
        self.uri, self.size, self.version = uri, size, version
        actual = os.fstat(fd).st_size
        if actual != size:
            raise CacheProtocolError(f"{uri}: the cache's segment is {actual} bytes; the daemon said {size}")
        # A private mapping by path (no descriptor is kept): torch opens it read-only, writes stay private.
        self._bytes = (
            torch.from_file(f"/proc/self/fd/{fd}", shared=False, size=size, dtype=torch.uint8)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
        if head_digest(self._host_bytes(0, min(size, HEAD_BYTES))) != head:
            raise CacheProtocolError(f"{uri}: the cache's segment does not match the checksum of its first bytes")

    @property
    def bytes(self) -> torch.Tensor:
        """The file's bytes (uint8), a view of the mapping."""
        return self._bytes

    def device_bytes(self, device: torch.device) -> torch.Tensor:
        """The file's bytes on ``device``: the daemon's copy there, mapped read-only (``zero_copy=True`` on a GPU).

        Raises:
            DeviceUnavailableError: the daemon keeps no copy of this file on that GPU.
        """
        if self.copy_source is None or self.copy_source.device != device:
            raise DeviceUnavailableError(
                f"zero_copy=True on {device}: the cache daemon keeps no copy of {self.uri} on that GPU (start it with "
                f"`weightstream cache serve --device cuda:N` for it), or pass zero_copy='auto' to copy to owned memory"
            )
        return self.copy_source

    def read(self, offset: int, nbytes: int) -> bytes:
        self._check_range(offset, nbytes)
        return self._host_bytes(offset, nbytes)

    def _host_bytes(self, offset: int, nbytes: int) -> bytes:
        """A copy of ``nbytes`` from ``offset`` of the mapping (read through its address: no numpy)."""
        return ctypes.string_at(self._bytes.data_ptr() + offset, nbytes) if nbytes else b""

    def read_into(self, offset: int, buffer: memoryview) -> None:
        self._check_range(offset, len(buffer))
        if len(buffer):
            torch.frombuffer(buffer, dtype=torch.uint8).copy_(self._bytes[offset : offset + len(buffer)])

    def verify_unchanged(self) -> None:
        """A segment never changes (a read-only file, replaced only under another key)."""

    def close(self) -> None:
        """The mapping lives as long as tensors view it."""

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > self.size:
            raise TruncatedFileError(f"{self.uri}: bytes {offset}..{offset + nbytes} asked of a {self.size}-byte file")
