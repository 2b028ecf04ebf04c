"""Pieces between node caches over NIXL (UCX underneath: TCP or shared memory here, RDMA or NVLink where a node has
them). A node publishes each segment it holds by registering a read-only mapping of it: peers can read it, and a
write into it fails on the writer's side (the pages are not writable; tested). A filling node reads the pieces it
lacks from a peer straight into its own segment, and checks each against the sha256 its claimer published before
it counts.

NIXL is optional (``pip install 'weightstream[fleet]'``): importing this module without it raises
:class:`~weightstream.errors.CacheConfigError` with the hint; nothing else in weightstream imports it.

Example:
    >>> server = PieceServer("node-a")  # doctest: +SKIP
    >>> where = server.publish("3f2a...", segment_fd, size)  # doctest: +SKIP
    >>> fetcher = PieceFetcher("node-b")  # doctest: +SKIP
    >>> fetcher.read("node-a", where, 0, 64 << 20, destination_address)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import logging
import mmap
import os
import re
import sys
import threading
import time
from types import ModuleType

from weightstream.errors import CacheConfigError, FleetPeerError, MemoryStillInUseError, logger
from weightstream.nodecache.daemon.fleet.records import Offer
from weightstream.sources.local.raw_mapping import blank, fence_off, map_file, unmap

log = logger(__name__)

INSTALL_HINT = "pip install 'weightstream[fleet]' (NIXL: nixl-cu12, or nixl-cu13 beside a CUDA 13 torch)"
PIECE_TIMEOUT_S = 30.0
"""A piece a peer has not delivered in this long is given up (and claimed again elsewhere): no fill waits forever."""
POLL_S = 0.0005
PROGRESS_WAIT_US = 5000
"""How long NIXL's UCX progress thread waits for its workers' events before it looks anyway. ``nixl_agent`` sets 0,
and the thread then spins: measured here (nixl-cu12 1.5.1), an idle agent kept 100% of a CPU busy, a fleet daemon
(two agents) 198%; with 1 ms 2%, and a 256 MiB read ran as fast (0.9-1.07 GB/s over loopback TCP either way)."""
SERVED_NOTICE = re.compile(rb"served ([A-Za-z0-9][A-Za-z0-9._-]{0,252}) ([0-9]{1,10})")
"""What a reader's agent tells the agent it read from, as the read ends: the entry and the bytes read."""
_CONFIG_LOCK = threading.Lock()


def nixl() -> ModuleType:
    """NIXL's Python API (``nixl_cu12._api``, ``nixl_cu13._api`` or ``nixl._api``, the first installed).

    Raises:
        CacheConfigError: none is installed.
    """
    for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            api = importlib.import_module(name)
        except ImportError:
            continue
        _quiet(logging.getLogger("nixl"))
        return api
    raise CacheConfigError(f"--fleet needs NIXL, which is not installed: {INSTALL_HINT}")


def _quiet(nixl_logger: logging.Logger) -> None:
    """NIXL logs every agent's start at INFO on stdout, where the daemon prints its status as JSON: its lines go to
    stderr, warnings and worse (``NIXL_LOG_LEVEL`` still decides where it is set)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("NIXL %(levelname)s %(message)s"))
    nixl_logger.handlers[:] = [handler]
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


def _agent(name: str) -> object:
    """A NIXL agent on UCX that threads may call at once (transfers of several pieces under way together: NIXL's
    reader-writer sync mode), whose progress thread sleeps between events (see :data:`PROGRESS_WAIT_US`)."""
    api = nixl()
    sync = getattr(getattr(api, "nixl_thread_sync_t", None), "NIXL_THREAD_SYNC_RW", None)
    if sync is None:
        raise CacheConfigError(f"--fleet needs a NIXL with thread-safe agents (1.0 or later): {INSTALL_HINT}")
    config = api.nixl_agent_config(backends=["UCX"], sync_mode=sync)
    bindings = getattr(api, "nixlBind", None)
    original = getattr(bindings, "nixlAgentConfig", None)
    if original is None or not hasattr(original(), "pthrDelay"):
        log.warning("NIXL %s: its progress thread's wait cannot be set: it may keep a CPU busy", api.__name__)
        return api.nixl_agent(name, config)

    class Config(original):  # type: ignore[misc, valid-type]
        def __setattr__(self, field: str, value: object) -> None:
            super().__setattr__(field, PROGRESS_WAIT_US if field == "pthrDelay" else value)

    with _CONFIG_LOCK:
        bindings.nixlAgentConfig = Config
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgentConfig = original


class PieceServer:
    """The segments node ``node`` offers its peers: each mapped read-only and registered with its NIXL agent."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._agent = _agent(node)
        self._published: dict[str, tuple[int, int, object, bool]] = {}
        """Each offer: its address, size and registration, and whether this server mapped it (and unmaps it)."""
        self._blanked: list[tuple[float, int, int]] = []
        """Withdrawn segments' mappings, zero pages now: when each may be unmapped, its address and size."""
        self._served: dict[str, int] = {}
        self.bad_notices = 0
        """Notices from peers' agents that were not a count of bytes served (skipped; the first logged)."""
        self._lock = threading.Lock()

    def served(self) -> dict[str, int]:
        """The bytes of each entry peers have read from this node: what their agents told this one as each read
        ended (NIXL's notifications of one-sided reads; a count a peer never sent is not there). Collects the
        notices received since the last call (call it now and then: they wait in the agent until then).

        Example:
            >>> server.served()  # doctest: +SKIP
            {'3f2a...': 268435456}
        """
        with self._lock:
            for notices in self._agent.get_new_notifs().values():  # type: ignore[attr-defined]
                for notice in notices:
                    counted = SERVED_NOTICE.fullmatch(bytes(notice))
                    if counted is None:
                        self.bad_notices += 1
                        if self.bad_notices == 1:
                            log.warning(
                                "fleet: a peer's notice is not a count of bytes served: %s", ascii(notice)[:200]
                            )
                        continue
                    entry = counted[1].decode()
                    self._served[entry] = self._served.get(entry, 0) + int(counted[2])
            return dict(self._served)

    def publish(self, key: str, fd: int, size: int) -> Offer:
        """Offer segment ``key`` (the file ``fd``, ``size`` bytes) to peers; where they read it: its address, its size
        and the agent metadata a peer loads to reach it (this registration and how to connect, hex)."""
        address = map_file(fd, size, mmap.PROT_READ)
        try:
            return self._register(key, address, size, "DRAM", 0, mapped_here=True)
        except BaseException:
            unmap(address, size)
            raise

    def publish_memory(self, key: str, address: int, size: int, memory: str, device: int) -> Offer:
        """Offer ``size`` bytes at ``address`` as ``key``: memory of kind ``memory`` (``"VRAM"``: device ``device``'s,
        a device copy mapped read-only; ``"DRAM"``), which stays the caller's to unmap after :meth:`withdraw`."""
        return self._register(key, address, size, memory, device, mapped_here=False)

    def _register(self, key: str, address: int, size: int, memory: str, device: int, *, mapped_here: bool) -> Offer:
        registration = self._agent.register_memory([(address, size, device, "")], memory)  # type: ignore[attr-defined]
        with self._lock:
            self._published[key] = (address, size, registration, mapped_here)
        metadata = self._agent.get_partial_agent_metadata(registration, True)  # type: ignore[attr-defined]
        return Offer(address, size, memory, device, bytes(metadata).hex())

    def withdraw(self, key: str) -> None:
        """Stop offering ``key`` (evicted): peers reading it from now on fail and go elsewhere. A segment this server
        mapped no longer holds the file's pages when this returns: its mapping becomes zero pages at once (a read
        of a peer's still in flight, which UCX serves from that memory, gets zeros and fails its digest), unmapped
        by the first withdrawal ``PIECE_TIMEOUT_S`` or more later, when no read can still be under way (or at
        :meth:`close`)."""
        with self._lock:
            published = self._published.pop(key, None)
        if published is None:
            return
        address, size, registration, mapped_here = published
        try:
            self._agent.deregister_memory(registration)  # type: ignore[attr-defined]
        finally:
            if mapped_here:
                blank(address, size)
                with self._lock:
                    self._blanked.append((time.monotonic() + PIECE_TIMEOUT_S, address, size))
            self._unmap_blanked()

    def _unmap_blanked(self, everything: bool = False) -> None:
        """Unmap the blanked mappings no peer's read can still be using (``everything``: all, at close)."""
        now = time.monotonic()
        with self._lock:
            due = [held for held in self._blanked if everything or held[0] <= now]
            self._blanked = [held for held in self._blanked if held not in due]
        for _, address, size in due:
            unmap(address, size)

    def close(self) -> None:
        """Withdraw every offer (the fleet's keys are gone with the lease by now) and unmap what it mapped."""
        for key in list(self._published):
            self.withdraw(key)
        self._unmap_blanked(everything=True)


class PieceFetcher:
    """Reads pieces from peers' published segments into this node's memory, through its own NIXL agent: any number
    of transfers at once (each its own handle, bounded by its own deadline from its own start)."""

    def __init__(self, node: str, timeout_s: float = PIECE_TIMEOUT_S) -> None:
        self.node, self.timeout_s = node, timeout_s
        self._agent = _agent(node)
        self._peers: dict[str, str] = {}
        self._loaded: set[tuple[str, int]] = set()
        """(peer, address) of each published segment whose metadata this agent has loaded."""
        self._moving: dict[str, int] = {}
        """Transfers under way from each peer: a peer is forgotten once its last one ends."""
        self._forgetting: set[str] = set()
        """Peers to forget once their transfers end (reads from them wait for that, then load them again)."""
        self._stuck_handles: list[tuple[object, object, int, int, str, str]] = []
        """Each transfer kept out of use: its handle, registration, memory (address, bytes), memory kind and peer."""
        self._reaping = threading.Lock()
        """Held by the one :meth:`reap` under way: a transfer is released, and its memory unmapped, once."""
        self._handed_over: set[tuple[int, int]] = set()
        """Host memory kept out of use whose fill has unmapped the rest of its mapping (see :meth:`hand_over`)."""
        self._lock = threading.Condition()
        """Guards what is known of peers (never held across a transfer)."""

    def read(
        self,
        peer: str,
        where: Offer,
        offset: int,
        nbytes: int,
        destination: int,
        sha256: str | None = None,
        memory: str = "DRAM",
        device: int = 0,
        served_as: str | None = None,
    ) -> None:
        """Read ``nbytes`` at ``offset`` of what ``peer`` published as ``where`` (:meth:`PieceServer.publish`'s
        answer: a segment, or a device copy) into memory at ``destination`` (this process's, of kind ``memory`` on
        ``device``), and check them against ``sha256`` where given (host memory only). With ``served_as`` (an
        entry's key), the peer's agent is told once the bytes are read, for it to count them as served
        (:meth:`PieceServer.served`). Safe to call from many threads at once.

        Raises:
            FleetPeerError: the peer failed, stalled past the timeout, or the bytes are not the piece.
        """
        if offset < 0 or offset + nbytes > where.size:
            raise FleetPeerError(f"{peer}: bytes {offset}..{offset + nbytes} lie outside its {where.size}-byte offer")
        remote = (where.address, where.memory, where.device)
        if self._stuck_handles:
            self.reap()
        name = self._start(peer, where.address, bytes.fromhex(where.metadata))
        notice = b"" if served_as is None else f"served {served_as} {nbytes}".encode()
        kept = False
        try:
            self._transfer(peer, name, remote, offset, nbytes, (destination, memory, device), notice)
        except MemoryStillInUseError:
            kept = True  # still under way: it counts as moving (its peer is not dropped) until reaped
            raise
        finally:
            if not kept:
                self._end(peer)
        if sha256 is not None:
            got = hashlib.sha256(memory_at(destination, nbytes)).hexdigest()
            if got != sha256:
                raise FleetPeerError(
                    f"{peer}: bytes {offset}..{offset + nbytes} hash to {got[:16]}..., not the claimer's "
                    f"{sha256[:16]}...: discarded"
                )

    def _start(self, peer: str, address: int, metadata: bytes) -> str:
        """Count a transfer from ``peer`` under way; its agent's name, with the registration at ``address`` known
        (its metadata loaded once; after a :meth:`forget` still waiting on transfers, loaded again once they end)."""
        with self._lock:
            while peer in self._forgetting:
                if any(held[5] == peer for held in self._stuck_handles):  # may never end: no waiting on it
                    raise FleetPeerError(
                        f"{peer}: a transfer from it is kept out of use until it ends, and it is being forgotten: "
                        "nothing more is read from it meanwhile"
                    )
                self._lock.wait()
            if (peer, address) not in self._loaded:
                try:
                    name = self._agent.add_remote_agent(metadata)  # type: ignore[attr-defined]
                except Exception as error:  # noqa: BLE001 - NIXL cannot load it (NIXL_ERR_BACKEND, bad metadata)
                    raise FleetPeerError(f"{peer}: cannot reach its agent: {error}") from None
                self._peers[peer] = name.decode() if isinstance(name, bytes) else str(name)
                self._loaded.add((peer, address))
            self._moving[peer] = self._moving.get(peer, 0) + 1
            return self._peers[peer]

    def _end(self, peer: str) -> None:
        """A transfer from ``peer`` ended: the last one forgets it where that was asked meanwhile."""
        with self._lock:
            self._moving[peer] -= 1
            if not self._moving[peer]:
                del self._moving[peer]
                if peer in self._forgetting:
                    self._drop(peer)

    def _transfer(
        self,
        peer: str,
        name: str,
        remote: tuple[int, str, int],
        offset: int,
        nbytes: int,
        local: tuple[int, str, int],
        notice: bytes,
    ) -> None:
        """The NIXL READ itself of ``nbytes`` at ``offset`` of ``remote`` (agent ``name``'s) into ``local`` (each:
        address, memory kind, device), bounded by the timeout from its start; ``notice`` goes to the remote agent
        once it is done (nothing where empty).

        Raises:
            FleetPeerError: the peer failed or stalled.
            MemoryStillInUseError: the transfer could not be released (see :meth:`_release`).
        """
        agent = self._agent
        (remote_address, remote_memory, remote_device), (destination, memory, device) = remote, local
        registration = agent.register_memory([(destination, nbytes, device, "")], memory)  # type: ignore[attr-defined]
        stuck = False
        try:
            started = time.monotonic()
            handle = agent.initialize_xfer(  # type: ignore[attr-defined]
                "READ",
                agent.get_xfer_descs([(destination, nbytes, device)], memory),  # type: ignore[attr-defined]
                agent.get_xfer_descs([(remote_address + offset, nbytes, remote_device)], remote_memory),  # type: ignore[attr-defined]
                name,
                notice,
            )
            try:
                state = agent.transfer(handle)  # type: ignore[attr-defined]
                while state not in ("DONE", "ERR"):
                    if time.monotonic() - started > self.timeout_s:
                        stuck = True
                        self._keep_out_of_use(peer, handle, registration, local, nbytes, "not delivered in time")
                        raise MemoryStillInUseError(
                            f"{peer}: bytes {offset}..{offset + nbytes} not delivered in {self.timeout_s:.0f} s; "
                            f"the read may still land (a stopped peer answers when it resumes), so the {nbytes} "
                            f"bytes at {destination:#x} are kept out of use and their fill abandoned"
                        )
                    time.sleep(POLL_S)
                    state = agent.check_xfer_state(handle)  # type: ignore[attr-defined]
                if state == "ERR":
                    raise FleetPeerError(f"{peer}: the read of bytes {offset}..{offset + nbytes} failed")
            finally:
                if not stuck and not self._release(peer, handle, registration, local, nbytes):
                    stuck = True  # this error, not the transfer's: the fill's memory is no longer its own
                    raise MemoryStillInUseError(
                        f"{peer}: the read of bytes {offset}..{offset + nbytes} could not be stopped: the {nbytes} "
                        f"bytes it reads into at {destination:#x} are kept out of use, and their fill abandoned"
                    )
        except (FleetPeerError, MemoryStillInUseError):
            raise
        except Exception as error:  # noqa: BLE001 - NIXL's own errors (a peer gone: NIXL_ERR_REMOTE_DISCONNECT)
            raise FleetPeerError(f"{peer}: the read of bytes {offset}..{offset + nbytes} failed: {error}") from None
        finally:
            if not stuck:
                agent.deregister_memory(registration)  # type: ignore[attr-defined]

    def _release(
        self, peer: str, handle: object, registration: object, local: tuple[int, str, int], nbytes: int
    ) -> bool:
        """Release a finished transfer's ``handle``; whether it was. Where NIXL refuses, the transfer may still write
        the ``nbytes`` at ``local``: that memory is kept out of use (:meth:`_keep_out_of_use`)."""
        try:
            self._agent.release_xfer_handle(handle)  # type: ignore[attr-defined]
            return True
        except Exception as error:  # noqa: BLE001 - NIXL_ERR_REPOST_ACTIVE and the like
            self._keep_out_of_use(peer, handle, registration, local, nbytes, f"could not be released: {error}")
            return False

    def _keep_out_of_use(
        self, peer: str, handle: object, registration: object, local: tuple[int, str, int], nbytes: int, why: str
    ) -> None:
        """A transfer that may still write the ``nbytes`` at ``local``: a read past its deadline (releasing it only
        cancels the request, which NIXL's UCX backend itself says may not stop the transfer; a peer that was stopped
        answers when it resumes) or one NIXL would not release. Host memory is fenced off (a private mapping the fill
        never unmaps); the handle and its registration are kept, so no page under them is handed out again, until
        the transfer is seen to end (:meth:`reap`); until then it counts as moving from ``peer``, whose agent is not
        dropped under it (a late answer on a removed endpoint crashed the process: the 20-minute soak)."""
        destination, memory, _ = local
        log.error("fleet: a transfer into %#x (%d bytes) %s: kept out of use until it ends", destination, nbytes, why)
        if memory == "DRAM":
            fence_off(destination, nbytes)
        with self._lock:
            self._stuck_handles.append((handle, registration, destination, nbytes, memory, peer))

    @property
    def stuck(self) -> list[tuple[int, int]]:
        """Memory (address, bytes) that transfers kept out of use may still write: never reused until they end."""
        with self._lock:
            return [(held[2], held[3]) for held in self._stuck_handles]

    def hand_over(self, address: int, size: int) -> None:
        """The fill whose memory was ``size`` bytes at ``address`` has unmapped it, but for what is kept out of use
        there: :meth:`reap` may unmap those ranges once their transfers end (never before: the fill's own unmap would
        then hit whatever the kernel mapped into the hole meanwhile)."""
        with self._lock:
            self._handed_over.update(
                (held[2], held[3]) for held in self._stuck_handles if address <= held[2] < address + size
            )

    def reap(self) -> int:
        """Release the transfers kept out of use that have ended since (done or failed: nothing more can land), and
        unmap the memory they were fenced into; how many are still kept. Called as each read starts and at each
        renewal of the node's lease (one at a time: a second caller meanwhile returns at once)."""
        if not self._reaping.acquire(blocking=False):
            return len(self._stuck_handles)
        try:
            return self._reap()
        finally:
            self._reaping.release()

    def _reap(self) -> int:
        with self._lock:
            kept = list(self._stuck_handles)
        ended = []
        for held in kept:
            handle, registration, destination, nbytes, memory, _ = held
            if memory == "DRAM" and (destination, nbytes) not in self._handed_over:
                continue  # its fill still has the mapping around it: unmapped here only once the fill let go
            try:
                if self._agent.check_xfer_state(handle) not in ("DONE", "ERR"):  # type: ignore[attr-defined]
                    continue
                self._agent.release_xfer_handle(handle)  # type: ignore[attr-defined]
            except Exception as error:  # noqa: BLE001 - NIXL cannot tell, or will not release it yet: kept
                log.debug("fleet: the transfer kept out of use at %#x is not over: %s", destination, error)
                continue
            with contextlib.suppress(Exception):  # the transfer is over; a registration NIXL lost is gone either way
                self._agent.deregister_memory(registration)  # type: ignore[attr-defined]
            if memory == "DRAM":
                unmap(destination, nbytes)
            ended.append(held)
        with self._lock:
            for held in ended:
                self._stuck_handles.remove(held)
                self._handed_over.discard((held[2], held[3]))
        for held in ended:
            self._end(held[5])  # the peer may be forgotten now
        with self._lock:
            if ended:
                log.info("fleet: %d transfers kept out of use have ended: their memory is released", len(ended))
            return len(self._stuck_handles)

    def forget(self, peer: str) -> None:
        """Drop what is known of ``peer``'s agent (it left, restarted or failed): the next read loads it again.
        Transfers from it still under way end first (each by its deadline); the agent is dropped after the last."""
        with self._lock:
            if peer in self._moving:
                self._forgetting.add(peer)
            else:
                self._drop(peer)

    def _drop(self, peer: str) -> None:
        """Forget ``peer`` now (no transfer from it under way; called holding the lock)."""
        self._forgetting.discard(peer)
        self._loaded = {loaded for loaded in self._loaded if loaded[0] != peer}
        name = self._peers.pop(peer, None)
        self._lock.notify_all()
        if name is not None:
            try:
                self._agent.remove_remote_agent(name)  # type: ignore[attr-defined]
            except Exception as error:  # noqa: BLE001 - its metadata is gone either way; the next read loads it again
                log.warning("fleet: %s's agent not dropped cleanly: %s", peer, error)


def memory_at(address: int, nbytes: int) -> memoryview:
    """``nbytes`` of this process's memory at ``address``, without a copy (hashed at memory speed)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")
