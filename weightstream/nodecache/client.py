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

import contextlib
import ctypes
import errno
import json
import logging
import os
import pwd
import select
import socket
import struct
import threading
from collections.abc import Mapping
from typing import Protocol

import torch

from weightstream import errors
from weightstream.errors import (
    CacheError,
    CacheProtocolError,
    CacheRefusedError,
    CacheUnavailableError,
    DeviceUnavailableError,
    SourceChangedError,
    TruncatedFileError,
    logger,
)
from weightstream.nodecache.protocol import HEAD_BYTES, MAX_ANSWER_BYTES, close_all, head_digest, receive, send
from weightstream.sources.base import Source, Store
from weightstream.sources.http.store import HttpStore
from weightstream.sources.local.regular import open_regular

log = logger(__name__)

ENVIRONMENT = "WEIGHTSTREAM_CACHE"
"""The variable naming the daemon's socket for ``cache="auto"``."""
OWNER_ENVIRONMENT = "WEIGHTSTREAM_CACHE_UID"
"""The variable naming a daemon's user (besides this process's own and root) whose bytes a client accepts."""
PEER_CREDENTIALS = struct.Struct("3i")
CONNECT_TIMEOUT_S = 5.0
ANSWER_TIMEOUT_S = 3600.0
"""An attach waits for a fill, which may read a large file from a slow store."""


def default_socket() -> str:
    """Where the daemon listens unless told otherwise, in a directory no other user can create first:
    ``$XDG_RUNTIME_DIR/weightstream-cache.sock``, else ``/run/weightstream/cache.sock`` for root, else
    ``/tmp/weightstream-<uid>/cache.sock`` (the daemon makes that directory, owner-only; a client refuses it if
    another user made it).

    Example:
        >>> default_socket().endswith(".sock")
        True
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "weightstream-cache.sock")
    if os.getuid() == 0:
        return "/run/weightstream/cache.sock"
    return f"/tmp/weightstream-{os.getuid()}/cache.sock"


def trusted_uids() -> set[int]:
    """The users a client takes a daemon's bytes from: itself, root, and the one ``$WEIGHTSTREAM_CACHE_UID`` names
    (a uid or a user name: a daemon run as a dedicated user).

    Raises:
        CacheRefusedError: ``$WEIGHTSTREAM_CACHE_UID`` names no user.

    Example:
        >>> {0, os.getuid()} <= trusted_uids()
        True
    """
    trusted = {0, os.getuid()}
    named = os.environ.get(OWNER_ENVIRONMENT, "").strip()
    if named:
        try:
            trusted.add(int(named) if named.isdigit() else pwd.getpwnam(named).pw_uid)
        except KeyError:
            raise CacheRefusedError(f"${OWNER_ENVIRONMENT}={named[:64]!r}: no such user") from None
    return trusted


def resolve_socket(cache: str) -> tuple[str, bool]:
    """The socket ``cache`` names and whether it was asked for explicitly (``"auto"`` is not).

    Example:
        >>> resolve_socket("/run/ws.sock")
        ('/run/ws.sock', True)
    """
    if cache == "auto":
        return os.environ.get(ENVIRONMENT) or default_socket(), False
    return cache, True


class CacheClient:
    """One connection to the daemon, checked to be served by a trusted user (:func:`trusted_uids`); requests on it
    are serialised (one at a time)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._socket = _connect(path)

    def request(self, message: Mapping[str, object], fds: tuple[int, ...] = ()) -> tuple[dict[str, object], list[int]]:
        """Send ``message`` (with ``fds``); the answer and its descriptors (the caller closes them). A connection the
        daemon closed before the request (it drops clients silent for a while, or it restarted) is opened again;
        a request that reached the daemon is never sent twice.

        Raises:
            the typed error the daemon answered with (its class, message and errno; its cause as ``__cause__``).
            CacheUnavailableError: the daemon went away before answering.
        """
        with self._lock:
            if _closed_by_peer(self._socket):
                self._reconnect()
            answer, received = self._exchange(message, fds)
        if answer.get("ok") is True:
            return answer, received
        close_all(received)
        raise _typed_error(answer, self.path)

    def attach(
        self,
        uri: str,
        size: int | None = None,
        version: str | None = None,
        storage_options: Mapping[str, object] | None = None,
    ) -> tuple[dict[str, object], list[int]]:
        """Ask for the segment of ``uri`` (at ``version``, of ``size`` bytes, if given): the answer and its descriptor
        (the caller closes it). The daemon fills the segment first if it has none. A local file is opened here, with
        this process's rights, and passed to the daemon as a descriptor: the daemon reads what this process can.

        Raises:
            NotFound, SourceError, UnsupportedInputError: a local file this process cannot open (or not a regular
                file); the daemon's typed errors otherwise.
        """
        message = {"op": "attach", "uri": uri, "size": size, "version": version}
        return self.request_file({**message, "storage_options": dict(storage_options or {})})

    def request_file(self, message: Mapping[str, object]) -> tuple[dict[str, object], list[int]]:
        """:meth:`request` of a message naming a file (``uri``): a local one is opened here and goes as a
        descriptor, its path made absolute (the daemon has a working directory of its own)."""
        uri = daemon_uri(str(message["uri"]))
        if "://" in uri:
            return self.request(message)
        fd, _ = open_regular(uri)
        try:
            return self.request({**message, "uri": uri}, (fd,))
        finally:
            os.close(fd)

    def close(self) -> None:
        self._socket.close()

    def _reconnect(self) -> None:
        self._socket.close()
        self._socket = _connect(self.path)

    def _exchange(self, message: Mapping[str, object], fds: tuple[int, ...]) -> tuple[dict[str, object], list[int]]:
        """One request and its answer. A daemon that closed the connection may have said why first (a refused
        client): that answer is read even when sending failed; without one, the request never reached a daemon and
        is sent once more on a new connection."""
        what = f"the answer of the cache daemon at {self.path}"
        try:
            send(self._socket, message, fds)
        except (BrokenPipeError, ConnectionResetError):
            with contextlib.suppress(OSError, CacheUnavailableError):
                return receive(self._socket, MAX_ANSWER_BYTES, what)
            try:
                self._reconnect()
                send(self._socket, message, fds)
            except OSError as again:
                raise CacheUnavailableError(f"the cache daemon at {self.path} closed the connection") from again
        try:
            return receive(self._socket, MAX_ANSWER_BYTES, what)
        except TimeoutError as error:
            raise CacheUnavailableError(
                f"the cache daemon at {self.path} did not answer in {ANSWER_TIMEOUT_S:.0f} s"
            ) from error
        except ConnectionResetError as error:
            raise CacheUnavailableError(f"the cache daemon at {self.path} reset the connection") from error


def daemon_uri(uri: str) -> str:
    """``uri`` as the daemon names it: a local path (``file://`` or not) made absolute (the daemon has a working
    directory of its own; the file itself goes as a descriptor), any other URI as it is.

    Example:
        >>> daemon_uri("s3://bucket/model.safetensors"), daemon_uri("file:///m/model.safetensors")
        ('s3://bucket/model.safetensors', '/m/model.safetensors')
    """
    path = uri.removeprefix("file://")
    return path if "://" in path else os.path.abspath(path)


def _connect(path: str) -> socket.socket:
    """A connection to the daemon at ``path``, once the kernel says a trusted user serves it (``SO_PEERCRED``).

    Raises:
        CacheUnavailableError: nothing listens there.
        CacheRefusedError: another user listens there (a socket squatted before the daemon started).
    """
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    connection.settimeout(CONNECT_TIMEOUT_S)
    try:
        connection.connect(path)
        pid, uid, _ = PEER_CREDENTIALS.unpack(
            connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size)
        )
        trusted = trusted_uids()
    except OSError as error:
        connection.close()
        reason = "no such socket" if error.errno == errno.ENOENT else (error.strerror or str(error))
        raise CacheUnavailableError(f"no weightstream cache daemon at {path}: {reason}") from error
    except BaseException:
        connection.close()
        raise
    if uid not in trusted:
        connection.close()
        raise CacheRefusedError(
            f"{path}: the process listening there is uid {uid} (pid {pid}), not this user (uid {os.getuid()}), root "
            f"or ${OWNER_ENVIRONMENT}: its bytes are not taken"
        )
    connection.settimeout(ANSWER_TIMEOUT_S)
    return connection


def _closed_by_peer(connection: socket.socket) -> bool:
    """Whether the daemon closed ``connection`` (or sent something unasked) since the last answer."""
    readable, _, _ = select.select([connection], [], [], 0)
    return bool(readable)  # an end of file, a reset, or bytes unasked for: a fresh connection in every case


class CopySources(Protocol):
    """Gives each segment of a CUDA load its :attr:`SegmentSource.copy_source`
    (``weightstream.nodecache.gpu_import``)."""

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


def find_daemon(cache: str) -> str:
    """The socket of the daemon ``cache`` names (``"auto"``: ``$WEIGHTSTREAM_CACHE`` or the default), once one
    answers there.

    Raises:
        CacheUnavailableError: no daemon answers there.
        CacheRefusedError: another user listens there.

    Example:
        >>> find_daemon("/nonexistent/cache.sock")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        weightstream.errors.CacheUnavailableError: no weightstream cache daemon at /nonexistent/cache.sock: no such ...
    """
    path, _ = resolve_socket(cache)
    CacheClient(path).close()
    return path


def connect(cache: str) -> CacheClient | None:
    """A client of the daemon ``cache`` names, or None for ``"auto"`` when no daemon listens (logged once).

    Raises:
        CacheUnavailableError: an explicitly named socket has no daemon.
    """
    path, explicit = resolve_socket(cache)
    try:
        return CacheClient(path)
    except CacheUnavailableError as error:
        if explicit:
            raise
        # No socket is the usual case on a machine without the daemon: said only at DEBUG. Anything else (a
        # stale socket of a daemon that died, one that does not answer) is worth a line at every load.
        level = logging.DEBUG if isinstance(error.__cause__, FileNotFoundError) else logging.INFO
        log.log(level, "cache='auto': %s; reading from the source", error)
        return None


def _typed_error(answer: Mapping[str, object], path: str) -> Exception:
    """The error the daemon's answer carries, as its own type (a ``CacheError`` for a type this package does not
    know), with its errno and, as ``__cause__``, what caused it in the daemon."""
    name, message = answer.get("error"), answer.get("message")
    text = f"{message}" if isinstance(message, str) else f"the cache daemon at {path} answered {dict(answer)!r:.300}"
    kind = getattr(errors, name, None) if isinstance(name, str) else None
    if isinstance(kind, type) and issubclass(kind, errors.WeightstreamError):
        error: Exception = kind(text)
    else:
        error = CacheError(f"cache daemon at {path}: {text}")
    number = answer.get("errno")
    if isinstance(number, int) and not isinstance(number, bool):
        error.errno = number  # type: ignore[attr-defined]
    cause = answer.get("cause")
    if isinstance(cause, str):
        error.__cause__ = CacheError(f"in the cache daemon at {path}: {cause}")
    return error
