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
    >>> fetcher.read("node-a", server.metadata(), where, 0, 64 << 20, destination_address)  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import mmap
import threading
import time
from types import ModuleType

from weightstream.errors import CacheConfigError, FleetPeerError, logger
from weightstream.sources.local.raw_mapping import map_file, unmap

log = logger(__name__)

INSTALL_HINT = "pip install 'weightstream[fleet]' (NIXL: nixl-cu12, or nixl-cu13 beside a CUDA 13 torch)"
PIECE_TIMEOUT_S = 30.0
"""A piece a peer has not delivered in this long is given up (and claimed again elsewhere): no fill waits forever."""
POLL_S = 0.0005


def nixl() -> ModuleType:
    """NIXL's Python API (``nixl_cu12._api``, ``nixl_cu13._api`` or ``nixl._api``, the first installed).

    Raises:
        CacheConfigError: none is installed.
    """
    for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise CacheConfigError(f"--fleet needs NIXL, which is not installed: {INSTALL_HINT}")


def _agent(name: str) -> object:
    api = nixl()
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


class PieceServer:
    """The segments node ``node`` offers its peers: each mapped read-only and registered with its NIXL agent."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._agent = _agent(node)
        self._published: dict[str, tuple[int, int, object]] = {}
        self._lock = threading.Lock()

    def metadata(self) -> bytes:
        """What a peer needs to reach this node's agent (published in the fleet's etcd with the node)."""
        return bytes(self._agent.get_agent_metadata())  # type: ignore[attr-defined]

    def publish(self, key: str, fd: int, size: int) -> dict[str, int]:
        """Offer segment ``key`` (the file ``fd``, ``size`` bytes) to peers; where they read it."""
        address = map_file(fd, size, mmap.PROT_READ)
        try:
            registration = self._agent.register_memory([(address, size, 0, "")], "DRAM")  # type: ignore[attr-defined]
        except BaseException:
            unmap(address, size)
            raise
        with self._lock:
            self._published[key] = (address, size, registration)
        return {"address": address, "size": size}

    def withdraw(self, key: str) -> None:
        """Stop offering segment ``key`` (evicted): peers reading it from now on fail and go elsewhere."""
        with self._lock:
            published = self._published.pop(key, None)
        if published is not None:
            address, size, registration = published
            self._agent.deregister_memory(registration)  # type: ignore[attr-defined]
            unmap(address, size)

    def close(self) -> None:
        for key in list(self._published):
            self.withdraw(key)


class PieceFetcher:
    """Reads pieces from peers' published segments into this node's memory, through its own NIXL agent."""

    def __init__(self, node: str, timeout_s: float = PIECE_TIMEOUT_S) -> None:
        self.node, self.timeout_s = node, timeout_s
        self._agent = _agent(node)
        self._peers: dict[str, str] = {}
        self._lock = threading.Lock()

    def read(
        self,
        peer: str,
        metadata: bytes,
        where: dict[str, int],
        offset: int,
        nbytes: int,
        destination: int,
        sha256: str | None = None,
    ) -> None:
        """Read ``nbytes`` at ``offset`` of the segment ``peer`` published at ``where`` into memory at
        ``destination`` (this process's), and check them against ``sha256`` where given.

        Raises:
            FleetPeerError: the peer failed, stalled past the timeout, or the bytes are not the piece.
        """
        if offset < 0 or offset + nbytes > where["size"]:
            raise FleetPeerError(
                f"{peer}: bytes {offset}..{offset + nbytes} lie outside its {where['size']}-byte segment"
            )
        agent = self._agent
        name = self._remote(peer, metadata)
        local = agent.register_memory([(destination, nbytes, 0, "")], "DRAM")  # type: ignore[attr-defined]
        try:
            started = time.monotonic()
            handle = agent.initialize_xfer(  # type: ignore[attr-defined]
                "READ",
                agent.get_xfer_descs([(destination, nbytes, 0)], "DRAM"),  # type: ignore[attr-defined]
                agent.get_xfer_descs([(where["address"] + offset, nbytes, 0)], "DRAM"),  # type: ignore[attr-defined]
                name,
            )
            try:
                state = agent.transfer(handle)  # type: ignore[attr-defined]
                while state not in ("DONE", "ERR"):
                    if time.monotonic() - started > self.timeout_s:
                        raise FleetPeerError(
                            f"{peer}: bytes {offset}..{offset + nbytes} not delivered in {self.timeout_s:.0f} s"
                        )
                    time.sleep(POLL_S)
                    state = agent.check_xfer_state(handle)  # type: ignore[attr-defined]
                if state == "ERR":
                    raise FleetPeerError(f"{peer}: the read of bytes {offset}..{offset + nbytes} failed")
            finally:
                agent.release_xfer_handle(handle)  # type: ignore[attr-defined]
        except FleetPeerError:
            raise
        except Exception as error:  # noqa: BLE001 - NIXL's own errors (a peer gone: NIXL_ERR_REMOTE_DISCONNECT)
            raise FleetPeerError(f"{peer}: the read of bytes {offset}..{offset + nbytes} failed: {error}") from None
        finally:
            agent.deregister_memory(local)  # type: ignore[attr-defined]
        if sha256 is not None:
            got = hashlib.sha256(ctypes.string_at(destination, nbytes)).hexdigest()
            if got != sha256:
                raise FleetPeerError(
                    f"{peer}: bytes {offset}..{offset + nbytes} hash to {got[:16]}..., not the claimer's "
                    f"{sha256[:16]}...: discarded"
                )

    def forget(self, peer: str) -> None:
        """Drop what is known of ``peer``'s agent (it left, or restarted with new metadata)."""
        with self._lock:
            name = self._peers.pop(peer, None)
        if name is not None:
            self._agent.remove_remote_agent(name)  # type: ignore[attr-defined]

    def _remote(self, peer: str, metadata: bytes) -> str:
        with self._lock:
            if peer not in self._peers:
                name = self._agent.add_remote_agent(metadata)  # type: ignore[attr-defined]
                self._peers[peer] = name.decode() if isinstance(name, bytes) else str(name)
            return self._peers[peer]
