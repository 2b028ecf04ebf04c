"""The cache daemon: ``weightstream cache serve``.

It listens on a Unix socket (created owner-only, or for one group), checks every client's uid with
``SO_PEERCRED``, and answers length-prefixed JSON requests (``weightstream.nodecache.protocol``):
``attach`` a source file (filling its segment on a miss: one fill however many clients ask at once; a
fill that cannot fit is refused before any byte is read), ``device`` (its copy on a GPU the daemon
serves, ``weightstream.nodecache.daemon.device``), ``ls``, ``stats``, ``evict`` and ``stop``.
Each client has a thread; a client that sends nothing for ``idle_timeout_s`` is dropped, a malformed or
oversized message ends its connection, and at most ``max_clients`` are served at once. SIGTERM (or
``stop``) stops accepting, lets the requests in progress finish, and returns.

Segments outlive the daemon (``weightstream.nodecache.daemon.segments``): a restarted daemon adopts the complete
ones and discards the rest, and clients that mapped segments keep them whatever happens to the daemon.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import struct
import threading
from collections.abc import Callable, Mapping

from weightstream.errors import (
    CacheError,
    CacheProtocolError,
    CacheRefusedError,
    CacheUnavailableError,
    WeightstreamError,
    logger,
)
from weightstream.nodecache.daemon.device import DeviceTier
from weightstream.nodecache.daemon.segments import Segment, SegmentStore, segment_key
from weightstream.nodecache.protocol import MAX_REQUEST_BYTES, check_request, close_all, receive, send
from weightstream.sources import store_for
from weightstream.sources.base import Source, Store
from weightstream.sources.retry import RetryPolicy

log = logger(__name__)

CREDENTIALS = struct.Struct("3i")
"""``struct ucred``: pid, uid, gid."""


def default_directory() -> str:
    """Where segments live unless told otherwise: ``/dev/shm/weightstream-cache-<uid>`` (a tmpfs).

    Example:
        >>> default_directory().startswith("/dev/shm/weightstream-cache-")
        True
    """
    return f"/dev/shm/weightstream-cache-{os.getuid()}"


class CacheDaemon:
    """The daemon's state: its segments, its socket, the fills in progress and what it has served."""

    def __init__(
        self,
        directory: str,
        socket_path: str,
        budget: int | None = None,
        *,
        group: int | None = None,
        fill_threads: int = 16,
        idle_timeout_s: float = 10.0,
        max_clients: int = 64,
        huge_pages: str = "auto",
        devices: list[str] | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.group = group
        self.fill_threads = fill_threads
        self.idle_timeout_s = idle_timeout_s
        self.devices = None if not devices else DeviceTier(devices)
        self.segments = SegmentStore(directory, budget, huge_pages, on_evict=self._evicted)
        self._lock = threading.Lock()
        self._fills: dict[str, concurrent.futures.Future[Segment]] = {}
        self._pending_bytes = 0
        self._stores: dict[str, Store] = {}
        self.max_clients = max_clients
        self._clients = threading.BoundedSemaphore(max_clients)
        self._threads: set[threading.Thread] = set()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self.counters = {
            "attaches": 0,
            "hits": 0,
            "fills": 0,
            "bytes_filled": 0,
            "refused_clients": 0,
            "bad_requests": 0,
        }

    def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Listen and answer until :meth:`stop` (or SIGTERM where :meth:`install_signal_handlers` ran);
        ``on_ready`` runs once the socket listens."""
        self._listener = _listen(self.socket_path, self.group)
        log.info(
            "serving %s from %s: %d segments adopted (%d bytes), %d files discarded",
            self.socket_path,
            self.segments.directory,
            self.segments.adopted,
            self.segments.used_bytes,
            self.segments.discarded,
        )
        try:
            if on_ready is not None:
                on_ready()
            while not self._stopping.is_set():
                try:
                    connection, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError as error:
                    if self._stopping.is_set():
                        break
                    log.warning("accept failed: %s", error)
                    continue
                self._start_client(connection)
        finally:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            for thread in list(self._threads):
                thread.join(timeout=self.idle_timeout_s + 1)
            for store in self._stores.values():
                with contextlib.suppress(Exception):  # a store that fails to close must not keep the daemon up
                    store.close()
            if self.devices is not None:
                self.devices.close()
            log.info("stopped")

    def stop(self) -> None:
        """Stop accepting; :meth:`serve` returns once the requests in progress are answered."""
        self._stopping.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the daemon cleanly (call from the main thread)."""
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, lambda *_: self.stop())

    def status(self) -> dict[str, object]:
        """What ``stats`` answers (and ``serve --json`` prints at start)."""
        references = self.segments.references()
        with self._lock:
            return {
                "socket": self.socket_path,
                "directory": self.segments.directory,
                "budget": self.segments.budget,
                "huge_pages": self.segments.filesystem_huge_pages not in (None, "never", "deny"),
                "entries": len(self.segments.segments),
                "bytes": self.segments.used_bytes,
                "filling": len(self._fills),
                "referenced_entries": sum(1 for key in self.segments.segments if references.get(key)),
                "referencing_processes": len(set().union(*references.values())) if references else 0,
                "adopted": self.segments.adopted,
                "discarded": self.segments.discarded,
                "devices": {} if self.devices is None else self.devices.status(),
                **self.counters,
            }

    def _count(self, counter: str) -> None:
        """One more of ``counter`` (client threads count at once)."""
        with self._lock:
            self.counters[counter] += 1

    def _start_client(self, connection: socket.socket) -> None:
        if not self._clients.acquire(blocking=False):
            log.warning("refusing a client: %d are connected already", self.max_clients)
            connection.close()
            return
        thread = threading.Thread(
            target=self._serve_client, args=(connection,), name="weightstream-cache-client", daemon=True
        )
        self._threads.add(thread)
        thread.start()

    def _serve_client(self, connection: socket.socket) -> None:
        try:
            with connection:
                pid, uid, gid = CREDENTIALS.unpack(
                    connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, CREDENTIALS.size)
                )
                if not self._allowed(pid, uid, gid):
                    self._count("refused_clients")
                    log.warning("refused a client: pid %d, uid %d (this daemon serves uid %d)", pid, uid, os.getuid())
                    served = f"uid {os.getuid()}" + (f" and group {self.group}" if self.group is not None else "")
                    refusal = CacheRefusedError(
                        f"the cache daemon at {self.socket_path} serves {served}; this process is uid {uid}"
                    )
                    with contextlib.suppress(OSError):
                        send(connection, _error(refusal))
                    return
                connection.settimeout(self.idle_timeout_s)
                while not self._stopping.is_set():
                    try:
                        request, fds = receive(connection, MAX_REQUEST_BYTES, f"a request from pid {pid}")
                        close_all(fds)  # clients send none; any that came are not kept
                        op = check_request(request)
                    except (CacheUnavailableError, TimeoutError, ConnectionError):
                        return  # the client left, or said nothing for too long
                    except CacheProtocolError as error:
                        self._count("bad_requests")
                        log.warning("bad request from pid %d: %s", pid, error)
                        with contextlib.suppress(OSError):
                            send(connection, _error(error))
                        return
                    self._answer(connection, op, request)
        except Exception:
            log.exception("a client's connection failed")
        finally:
            self._threads.discard(threading.current_thread())
            self._clients.release()

    def _answer(self, connection: socket.socket, op: str, request: Mapping[str, object]) -> None:
        fd = None
        try:
            if op == "attach":
                answer, fd = self._attach(request)
            elif op == "device":
                answer, fd = self._device(request)
            elif op == "ls":
                answer = self._ls()
            elif op == "stats":
                answer = {"ok": True, **self.status()}
            elif op == "evict":
                answer = self._evict(request.get("key"))  # type: ignore[arg-type]
            else:
                answer = {"ok": True, "stopping": True}
                self.stop()
        except WeightstreamError as error:
            answer = _error(error)
        except OSError as error:
            answer = _error(CacheError(f"{error.strerror or error}"))
        try:
            send(connection, answer, () if fd is None else (fd,))
        finally:
            if fd is not None:
                os.close(fd)

    def _attach(self, request: Mapping[str, object]) -> tuple[dict[str, object], int]:
        uri = str(request["uri"])
        size, version = request.get("size"), request.get("version")
        store = self._store(uri, request.get("storage_options") or {})  # type: ignore[arg-type]
        # A cold local file is read around the page cache: the segment is its only copy in memory.
        if size is not None and version is not None:
            source = store.open_pinned(uri, size, version, direct="auto")  # type: ignore[arg-type]
        else:
            source = store.open(uri, direct="auto")
        try:
            key = segment_key(uri, source.size, source.version)
            with self._lock:
                self.counters["attaches"] += 1
                segment = self.segments.segments.get(key)
                fill = self._fills.get(key)
                owner = segment is None and fill is None
                if owner:
                    self.segments.make_room(
                        source.size + self._pending_bytes,
                        lambda: set(self.segments.references()) | set(self._fills),
                        uri,
                    )
                    fill = self._fills[key] = concurrent.futures.Future()
                    self._pending_bytes += source.size
            if owner:
                segment = self._fill(key, source, fill)  # type: ignore[arg-type]
            elif segment is None:
                segment = fill.result()  # type: ignore[union-attr]  # another client's fill: read once
            else:
                self._count("hits")
        finally:
            source.close()
        with self._lock:
            fd = self.segments.open_segment(segment.key)
        return {
            "ok": True,
            "key": segment.key,
            "size": segment.size,
            "version": segment.version,
            "head_sha256": segment.head_sha256,
            "gpus": [] if self.devices is None else self.devices.uuids,
        }, fd

    def _device(self, request: Mapping[str, object]) -> tuple[dict[str, object], int]:
        """The segment of the file (filled as for ``attach``), then its copy on the GPU the request names."""
        gpu = str(request["gpu"])
        if self.devices is None:
            raise CacheError(
                f"this cache daemon keeps no device copies (start it with --device cuda:N); asked for {gpu}"
            )
        answer, segment_fd = self._attach({name: value for name, value in request.items() if name != "gpu"})
        os.close(segment_fd)
        key, size = str(answer["key"]), int(answer["size"])  # type: ignore[call-overload]
        fd, allocation_bytes = self.devices.copy_of(key, gpu, self.segments.path(key), size, str(request["uri"]))
        return {**answer, "gpu": gpu, "allocation_bytes": allocation_bytes}, fd

    def _evicted(self, key: str) -> None:
        """A segment left the cache: so do its device copies."""
        if self.devices is not None:
            self.devices.drop(key)

    def _fill(self, key: str, source: Source, fill: concurrent.futures.Future[Segment]) -> Segment:
        try:
            segment = self.segments.fill(key, source, self.fill_threads)
        except BaseException as error:
            fill.set_exception(error)
            with self._lock:
                self._fills.pop(key, None)
                self._pending_bytes -= source.size
            raise
        with self._lock:
            self.segments.publish(segment)
            self._fills.pop(key, None)
            self._pending_bytes -= segment.size
            self.counters["fills"] += 1
            self.counters["bytes_filled"] += segment.size
        log.info("filled %s (%s, %d bytes) in %.2f s", key, segment.uri, segment.size, segment.filled_seconds)
        fill.set_result(segment)
        return segment

    def _ls(self) -> dict[str, object]:
        references = self.segments.references()
        with self._lock:
            entries = [
                {**segment.describe(), "references": sorted(references.get(key, ()))}
                for key, segment in sorted(self.segments.segments.items(), key=lambda item: item[1].last_used)
            ]
        return {"ok": True, "entries": entries}

    def _evict(self, key: str | None) -> dict[str, object]:
        references = self.segments.references()
        with self._lock:
            wanted = list(self.segments.segments) if key is None else [key]
            if key is not None and key not in self.segments.segments:
                raise CacheError(f"no cache entry {key[:40]!r}")
            evicted = [name for name in wanted if not references.get(name)]
            for name in evicted:
                self.segments.evict(name)
        return {"ok": True, "evicted": evicted, "kept_referenced": [name for name in wanted if name not in evicted]}

    def _store(self, uri: str, storage_options: Mapping[str, object]) -> Store:
        identity = json.dumps([uri.split("://", 1)[0] if "://" in uri else "file", storage_options], sort_keys=True)
        with self._lock:
            store = self._stores.get(identity)
            if store is None:
                store = self._stores[identity] = store_for(uri, storage_options, RetryPolicy(5, 30.0, None))
            return store

    def _allowed(self, pid: int, uid: int, gid: int) -> bool:
        if uid == os.getuid():
            return True
        if self.group is None:
            return False
        return gid == self.group or self.group in _supplementary_groups(pid)


def _listen(path: str, group: int | None) -> socket.socket:
    """A listening socket at ``path``, owner-only (or owner and ``group``); a stale socket file is replaced,
    a live daemon's is not."""
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a daemon that died left it
        else:
            raise CacheError(f"{path}: another cache daemon is listening there")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    previous = os.umask(0o177 if group is None else 0o117)
    try:
        listener.bind(path)
    except OSError as error:
        listener.close()
        raise CacheError(f"{path}: cannot listen there: {error.strerror}") from error
    finally:
        os.umask(previous)
    if group is not None:
        os.chown(path, -1, group)
    listener.listen(128)
    listener.settimeout(0.2)
    return listener


def _supplementary_groups(pid: int) -> set[int]:
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Groups:"):
                return {int(group) for group in line.split()[1:]}
    return set()


def _error(error: Exception) -> dict[str, object]:
    return {"ok": False, "error": type(error).__name__, "message": str(error)}


def run_daemon(
    directory: str,
    socket_path: str,
    budget: int | None,
    *,
    group: int | None = None,
    status: bool = False,
    idle_timeout_s: float = 10.0,
    huge_pages: str = "auto",
    devices: list[str] | None = None,
) -> int:
    """``weightstream cache serve``: run in the foreground until SIGTERM; 0 on a clean stop."""
    daemon = CacheDaemon(
        directory,
        socket_path,
        budget,
        group=group,
        idle_timeout_s=idle_timeout_s,
        huge_pages=huge_pages,
        devices=devices,
    )
    daemon.install_signal_handlers()
    daemon.serve(on_ready=(lambda: print(json.dumps(daemon.status()), flush=True)) if status else None)
    return 0
