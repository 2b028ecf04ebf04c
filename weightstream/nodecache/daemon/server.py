"""The cache daemon: ``weightstream cache serve``.

It listens on a Unix socket (created owner-only, or for one group), checks every client's credentials with
``SO_PEERCRED`` (and its groups with ``SO_PEERGROUPS``), and answers length-prefixed JSON requests
(``weightstream.nodecache.protocol``): ``attach`` a source file (filling its segment on a miss: one fill however
many clients ask at once; a fill that cannot fit is refused before any byte is read), ``device`` (its copy on a GPU
the daemon serves, ``weightstream.nodecache.daemon.device``), ``room``, ``stats``, and, for the daemon's own user
only, ``ls``, ``evict`` and ``stop``.

A client gets only bytes it could read itself: a local file comes as a descriptor the client opened (the entry is
keyed by the file's identity, never its path); a remote source is opened with the client's own credentials unless
the client runs as the daemon's own user (``weightstream.nodecache.daemon.credentials``), and with a request to the
store, so the client has shown it may read the source before any entry is handed to it.

Each client has a thread; a request must arrive whole within ``idle_timeout_s`` of the daemon starting to wait for
it, a malformed or oversized message ends its connection, and at most ``max_clients`` are served at once. SIGTERM
(or ``stop``) stops accepting, closes idle and slow clients, lets fills finish within ``stop_timeout_s`` (then
cancels them, and their clients get the error), and returns.

Segments outlive the daemon (``weightstream.nodecache.daemon.segments``): a restarted daemon adopts the complete
ones and discards the rest, and clients that mapped segments keep them whatever happens to the daemon.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from weightstream.errors import (
    CacheError,
    CacheProtocolError,
    CacheRefusedError,
    CacheUnavailableError,
    WeightstreamError,
    logger,
)
from weightstream.nodecache.daemon.client_sources import open_for_client
from weightstream.nodecache.daemon.device import DeviceTier
from weightstream.nodecache.daemon.directory import CacheDirectory
from weightstream.nodecache.daemon.endpoint import Peer, listen, peer_of, unlink_if_ours
from weightstream.nodecache.daemon.entries import EntryTable
from weightstream.nodecache.daemon.owner_requests import evict, listing
from weightstream.nodecache.daemon.segments import Segment, SegmentStore
from weightstream.nodecache.daemon.stores import StorePool
from weightstream.nodecache.protocol import MAX_REQUEST_BYTES, check_request, close_all, error_answer, receive, send
from weightstream.sources.base import Source

if TYPE_CHECKING:
    from weightstream.nodecache.daemon.fleet.node import FleetNode

log = logger(__name__)

OWNER_OPERATIONS = frozenset({"ls", "evict", "stop"})
"""What only the daemon's own user may ask: a group member may use the cache, not list what others cached (their
files' paths), empty it or stop it."""


class CacheDaemon:
    """The daemon's state: its directory, segments and entries, its socket, its clients and stores."""

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
        device_budget: int | None = None,
        stop_timeout_s: float = 30.0,
        fleet: FleetNode | None = None,
    ) -> None:
        self.socket_path, self.fleet = socket_path, fleet
        self.group = group
        self.fill_threads = fill_threads
        self.idle_timeout_s = idle_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.directory = CacheDirectory(directory)
        try:
            self.segments = SegmentStore(directory, budget, huge_pages, on_evict=self._evicted)
            self.entries = EntryTable(self.segments, self.segments.references)
            self.devices = None if not devices else DeviceTier(devices, device_budget)
            if fleet is not None and self.devices is not None:  # device copies fill each other GPU to GPU
                self.devices.offers = fleet.use_devices(self.devices)
            if fleet is not None:  # what this node held before it started is the fleet's too
                fleet.offer(list(self.segments.segments.values()), self.segments.path)
        except BaseException:
            self.directory.release()
            raise
        self.stores = StorePool()
        self._lock = threading.Lock()
        self.max_clients = max_clients
        self.max_clients_per_user = max(1, max_clients // 2)
        """Connections one user other than the daemon's own may hold at once: no one client's user can take every
        slot (reconnecting as fast as slow requests are dropped)."""
        self._connections: dict[threading.Thread, tuple[socket.socket, Peer]] = {}
        """Each client's thread, its connection and who is at the other end: the counts the limits check."""
        self._stopping = threading.Event()
        self._cancel_fills = threading.Event()
        """Set when fills outlast ``stop_timeout_s`` at shutdown: their reads not yet started raise."""
        self._listener: socket.socket | None = None
        names = ("attaches", "hits", "fills", "fill_errors", "bytes_filled", "refused_clients", "bad_requests")
        self.counters = dict.fromkeys(names, 0)

    def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Listen and answer until :meth:`stop` (or SIGTERM where :meth:`install_signal_handlers` ran);
        ``on_ready`` runs once the socket listens. Then: no new client; idle and slow clients closed; fills in
        progress given ``stop_timeout_s`` to finish (then cancelled, their clients told); stores, device copies and
        the directory released."""
        try:
            self._listener, bound = listen(self.socket_path, self.group)
        except BaseException:
            self._release()
            raise
        budget = self.segments.budget
        log.info(
            "serving %s from %s, budget %s: %d segments adopted (%d bytes), %d files discarded; %s",
            self.socket_path,
            self.segments.directory,
            "as much as fits" if budget is None else f"{budget} bytes",
            self.segments.adopted,
            self.segments.used_bytes,
            self.segments.discarded,
            "not in a fleet" if self.fleet is None else f"in the fleet as {self.fleet.membership.node}",
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
            unlink_if_ours(self.socket_path, bound)
            self._drain()
            self._release()
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
            counters = dict(self.counters)
        segments = dict(self.segments.segments)
        return {
            "socket": self.socket_path,
            "directory": self.segments.directory,
            "budget": self.segments.budget,
            "huge_pages": self.segments.filesystem_huge_pages not in (None, "never", "deny"),
            "entries": len(segments),
            "bytes": sum(segment.size for segment in segments.values()),
            "filling": self.entries.filling,
            "referenced_entries": sum(1 for key in segments if references.get(key)),
            "referencing_processes": len(set().union(*references.values())) if references else 0,
            "adopted": self.segments.adopted,
            "discarded": self.segments.discarded,
            "stores": len(self.stores),
            "clients": len(self._connections),
            "devices": {} if self.devices is None else self.devices.status(),
            "fleet": None if self.fleet is None else self.fleet.status(),
            **counters,
        }

    def _count(self, counter: str) -> None:
        with self._lock:
            self.counters[counter] += 1

    def _start_client(self, connection: socket.socket) -> None:
        try:
            peer = peer_of(connection)
        except OSError:  # gone already
            connection.close()
            return
        thread = threading.Thread(
            target=self._serve_client, args=(connection, peer), name="weightstream-cache-client", daemon=True
        )
        with self._lock:
            full = len(self._connections) >= self.max_clients
            held = sum(1 for _, other in self._connections.values() if other.uid == peer.uid)
            crowded = not full and not peer.owner and held >= self.max_clients_per_user
            if not full and not crowded:
                self._connections[thread] = (connection, peer)
        if full:
            log.warning("refusing a client: %d are connected already", self.max_clients)
            connection.close()
            return
        if crowded:
            self._count("refused_clients")
            log.warning("refusing a client of uid %d: it holds %d connections already", peer.uid, held)
            with contextlib.suppress(OSError):
                send(connection, error_answer(CacheRefusedError(f"uid {peer.uid} holds {held} connections already")))
            connection.close()
            return
        thread.start()

    def _serve_client(self, connection: socket.socket, peer: Peer) -> None:
        try:
            with connection:
                if not self._allowed(peer):
                    self._refuse(connection, peer)
                    return
                while not self._stopping.is_set():
                    deadline = time.monotonic() + self.idle_timeout_s
                    try:
                        request, fds = receive(
                            connection, MAX_REQUEST_BYTES, f"a request from pid {peer.pid}", deadline
                        )
                    except (CacheUnavailableError, OSError):
                        return  # the client left, sent nothing whole in time, or the daemon is stopping
                    except CacheProtocolError as error:
                        self._bad_request(connection, peer, error)
                        return
                    try:
                        op = check_request(request)
                    except CacheProtocolError as error:
                        close_all(fds)
                        self._bad_request(connection, peer, error)
                        return
                    self._answer(connection, peer, op, request, fds)
        except Exception:
            log.exception("a client's connection failed")
        finally:
            with self._lock:
                self._connections.pop(threading.current_thread(), None)

    def _refuse(self, connection: socket.socket, peer: Peer) -> None:
        self._count("refused_clients")
        log.warning("refused a client: pid %d, uid %d (this daemon serves uid %d)", peer.pid, peer.uid, os.getuid())
        served = f"uid {os.getuid()}" + (f" and group {self.group}" if self.group is not None else "")
        refusal = CacheRefusedError(
            f"the cache daemon at {self.socket_path} serves {served}; this process is uid {peer.uid}"
        )
        with contextlib.suppress(OSError):
            send(connection, error_answer(refusal))

    def _bad_request(self, connection: socket.socket, peer: Peer, error: CacheProtocolError) -> None:
        self._count("bad_requests")
        log.warning("bad request from pid %d: %s", peer.pid, error)
        with contextlib.suppress(OSError):
            send(connection, error_answer(error))

    def _answer(
        self, connection: socket.socket, peer: Peer, op: str, request: Mapping[str, object], fds: list[int]
    ) -> None:
        """Answer one request (the descriptors that came with it are this call's to close)."""
        with contextlib.ExitStack() as held:
            held.callback(close_all, fds)
            fd = None
            try:
                if op in OWNER_OPERATIONS and not peer.owner:
                    raise CacheRefusedError(
                        f"{op}: only the daemon's own user (uid {os.getuid()}) may; this is uid {peer.uid}"
                    )
                if op == "attach":
                    answer, fd = held.enter_context(self._attached(peer, request, fds))
                elif op == "device":
                    answer, fd = held.enter_context(self._device(peer, request, fds))
                elif op == "room":
                    self.entries.room_for(int(request["bytes"]), str(request.get("uri") or "the checkpoint"))  # type: ignore[call-overload]
                    answer = {"ok": True}
                elif op == "ls":
                    answer = listing(self.segments)
                elif op == "stats":
                    answer = {"ok": True, **self.status()}
                elif op == "evict":
                    answer = evict(request, self.segments, self.entries)
                else:
                    answer = {"ok": True, "stopping": True}
                    self.stop()
            except (WeightstreamError, OSError) as error:
                answer = error_answer(error)
            except Exception as error:  # a defect of the daemon's: the client still gets an answer, typed
                log.exception("answering %s failed", op)
                answer = error_answer(error)
            with contextlib.suppress(OSError):  # a client that left: nothing to tell
                send(connection, answer, () if fd is None else (fd,))

    @contextlib.contextmanager
    def _attached(
        self, peer: Peer, request: Mapping[str, object], fds: list[int], gpu: str | None = None
    ) -> Iterator[tuple[dict[str, object], int]]:
        """The answer to an attach and the segment's descriptor, the entry pinned while they are sent (filled for a
        client that wants its copy on GPU ``gpu``, where one is named)."""
        with open_for_client(peer, request, fds, self.stores) as (source, key):
            self._count("attaches")
            with self.entries.hand_out(key, source.size, source.uri, lambda: self._fill(key, source, gpu)) as (
                segment,
                filled,
            ):
                if not filled:
                    self._count("hits")
                fd = os.open(self.segments.path(key), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    yield (
                        {
                            "ok": True,
                            "key": key,
                            "size": segment.size,
                            "version": segment.version,
                            "head_sha256": segment.head_sha256,
                            "gpus": [] if self.devices is None else self.devices.uuids,
                            "filled": filled,
                        },
                        fd,
                    )
                finally:
                    os.close(fd)

    @contextlib.contextmanager
    def _device(
        self, peer: Peer, request: Mapping[str, object], fds: list[int]
    ) -> Iterator[tuple[dict[str, object], int]]:
        """The segment of the file (filled as for ``attach``), then its copy on the GPU the request names."""
        gpu = str(request["gpu"])
        if self.devices is None:
            raise CacheError(
                f"this cache daemon keeps no device copies (start it with --device cuda:N); asked for {gpu}"
            )
        segment_request = {name: value for name, value in request.items() if name != "gpu"}
        served = gpu if gpu in self.devices.uuids else None  # another GPU: the host tier filled, then refused
        with self._attached(peer, segment_request, fds, served) as (answer, _):
            key, size = str(answer["key"]), int(answer["size"])  # type: ignore[call-overload]
            fd, allocation_bytes = self.devices.copy_of(key, gpu, self.segments.path(key), size, str(request["uri"]))
            try:
                yield {**answer, "gpu": gpu, "allocation_bytes": allocation_bytes}, fd
            finally:
                os.close(fd)

    def _evicted(self, key: str) -> None:
        """A segment left the cache: so do its device copies, and the fleet's offer of it."""
        if self.devices is not None:
            self.devices.drop(key)
        if self.fleet is not None:
            self.fleet.evicted(key)

    def _fill(self, key: str, source: Source, gpu: str | None = None) -> Segment:
        try:
            segment = self.segments.fill(key, source, self.fill_threads, self._cancel_fills, self.fleet, gpu)
        except BaseException as error:
            self._count("fill_errors")
            log.warning("fill of %s (%s) failed: %s: %s", key, source.uri, type(error).__name__, error)
            raise
        with self._lock:
            self.counters["fills"] += 1
            self.counters["bytes_filled"] += segment.size
        log.info("filled %s (%s, %d bytes) in %.2f s", key, segment.uri, segment.size, segment.filled_seconds)
        return segment

    def _allowed(self, peer: Peer) -> bool:
        if peer.owner:
            return True
        return self.group is not None and (peer.gid == self.group or self.group in peer.groups)

    def _drain(self) -> None:
        """After the listener closed: end every client's wait for a request (their sockets shut for reading, so a
        slow or idle client is dropped at once), cancel fills that outlast ``stop_timeout_s`` (their clients get
        the error), and wait for the client threads."""
        with self._lock:
            connections = dict(self._connections)
        for connection, _ in connections.values():
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RD)
        fills = self.entries.fills_in_progress()
        if fills:
            log.info("stopping: %d fills in progress, %.0f s to finish", len(fills), self.stop_timeout_s)
            _, unfinished = concurrent.futures.wait(fills, timeout=self.stop_timeout_s)
            if unfinished:
                log.warning("stopping: cancelling %d fills that did not finish in time", len(unfinished))
                self._cancel_fills.set()
                concurrent.futures.wait(unfinished)
        for thread in connections:
            thread.join(timeout=self.stop_timeout_s)

    def _release(self) -> None:
        if self.fleet is not None:
            self.fleet.close()
        self.stores.close()
        if self.devices is not None:
            self.devices.close()
        self.directory.release()
