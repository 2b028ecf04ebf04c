"""One entry filled by a fleet: its bytes cut into pieces, each read from the origin by the one node that claims it
and fetched by every other node from a node that holds it, so the origin serves about one copy whatever the number
of nodes; a node that comes later fetches everything from peers.

Keys (under the fleet's prefix; the entry key already holds the origin's version, so versions never mix):

- ``pieces/{entry}/{piece}``: the claim (``claims.py``), under the claimer's lease;
- ``digests/{entry}/{piece}``: the piece's sha256, written by the node that read it from the origin (no lease: it
  outlives that node, for every later fetch to be checked);
- ``segments/{entry}/{node}``: where ``node``'s copy of the entry is, for peers to read (under its lease);
- ``complete/{entry}/{node}``: ``node`` holds every piece (under its lease): a late joiner's source;
- ``failed/{entry}``: the origin changed (or failed for good) under a node: every node's fill ends with that error.

Example:
    >>> stats = FleetFill(fleet, fetcher, server).fill(entry, fd, size, read_origin)  # doctest: +SKIP
    >>> stats.origin_bytes, stats.peer_bytes  # doctest: +SKIP
    (67108864, 201326592)
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import mmap
import time
from collections.abc import Callable

from weightstream.errors import FleetPeerError, SourceChangedError, logger
from weightstream.nodecache.daemon.fleet.claims import Claims
from weightstream.nodecache.daemon.fleet.membership import Membership
from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher, PieceServer
from weightstream.sources.local.raw_mapping import map_file, unmap

log = logger(__name__)

PIECE_BYTES = 64 << 20
"""A piece: large enough that its three etcd round trips (claim, digest, done) cost nothing beside moving it, small
enough that a few nodes filling a 1 GiB file share 16 pieces and a late piece waits for little."""
STALL_S = 30.0
"""A piece claimed by a node that has not finished it in this long is read from the origin by whoever waits."""
POLL_S = 0.05

ReadOrigin = Callable[[int, int, int], None]
"""``read_origin(offset, nbytes, address)``: the origin's bytes ``offset..offset+nbytes`` into memory at ``address``
(pinned to the entry's version: a changed origin raises :class:`SourceChangedError`)."""


@dataclasses.dataclass
class FillStats:
    """Where one fill's bytes came from."""

    origin_bytes: int = 0
    peer_bytes: int = 0
    refetched_bytes: int = 0
    """Pieces a peer served that failed their check (or that a peer failed to serve), read from the origin again."""
    pieces_verified: int = 0
    peer_failures: int = 0


class FleetFill:
    """Fills entries with the fleet this node is a member of (``membership``), reading pieces from peers with
    ``fetcher`` and offering its own with ``server``."""

    def __init__(
        self,
        membership: Membership,
        fetcher: PieceFetcher,
        server: PieceServer,
        piece_bytes: int = PIECE_BYTES,
        stall_s: float = STALL_S,
    ) -> None:
        self.membership, self.fetcher, self.server = membership, fetcher, server
        self.etcd, self.node = membership.etcd, membership.node
        self.prefix = membership.nodes_prefix.removesuffix("nodes/")
        self.piece_bytes, self.stall_s = piece_bytes, stall_s

    def fill(self, entry: str, fd: int, size: int, read_origin: ReadOrigin) -> FillStats:
        """Fill the file ``fd`` (``size`` bytes long already) with ``entry``'s bytes; where they came from.

        Raises:
            SourceChangedError: the origin changed during the fill, here or on another node (nothing is published).
            SourceError and the origin's other errors: reading a piece from the origin failed.
            FleetUnavailableError: etcd went away (the caller may fill from the origin alone).
        """
        stats = FillStats()
        address = map_file(fd, size, mmap.PROT_READ | mmap.PROT_WRITE)
        claims = Claims(self.etcd, self.prefix, self.node, self.membership.lease)
        try:
            where = self.server.publish(entry, fd, size)
            self.etcd.put(self._key("segments", entry, self.node), json.dumps(where).encode(), self.membership.lease)
            pending = set(range(-(-size // self.piece_bytes)))
            waiting_since: dict[int, float] = {}
            while pending:
                self._check_failed(entry)
                progressed = False
                records = claims.pieces(entry)
                for piece in sorted(pending):
                    if self._take(entry, piece, records.get(piece), claims, address, size, read_origin, stats,
                                  waiting_since):  # fmt: skip
                        pending.discard(piece)
                        progressed = True
                if not progressed:
                    time.sleep(POLL_S)
            self.etcd.put(self._key("complete", entry, self.node), json.dumps(where).encode(), self.membership.lease)
            return stats
        except SourceChangedError as error:
            self.etcd.put(self._key("failed", entry), str(error).encode())
            self.server.withdraw(entry)
            raise
        except BaseException:
            self.server.withdraw(entry)
            raise
        finally:
            unmap(address, size)

    def _take(
        self,
        entry: str,
        piece: int,
        record: dict[str, object] | None,
        claims: Claims,
        address: int,
        size: int,
        read_origin: ReadOrigin,
        stats: FillStats,
        waiting_since: dict[int, float],
    ) -> bool:
        """Make piece ``piece`` local if it can be now; whether it is."""
        offset = piece * self.piece_bytes
        nbytes = min(self.piece_bytes, size - offset)
        digest = self.etcd.get(self._key("digests", entry, str(piece)))
        holders = self._complete_holders(entry)
        if digest is not None and holders:  # a node holds the whole entry: fetch from it (a late joiner's way)
            return self._fetch(entry, piece, holders[piece % len(holders)], offset, nbytes, address, digest.decode(),
                               read_origin, stats)  # fmt: skip
        if record is None:
            won, record = claims.claim(entry, piece)
            if not won:
                return False
        if record.get("node") == self.node:
            read_origin(offset, nbytes, address + offset)
            sha256 = hashlib.sha256(ctypes.string_at(address + offset, nbytes)).hexdigest()
            self.etcd.put(self._key("digests", entry, str(piece)), sha256.encode())
            claims.done(entry, piece, sha256)
            stats.origin_bytes += nbytes
            return True
        if record.get("state") == "done":
            return self._fetch(entry, piece, str(record["node"]), offset, nbytes, address, str(record["sha256"]),
                               read_origin, stats)  # fmt: skip
        started = waiting_since.setdefault(piece, time.monotonic())
        if time.monotonic() - started < self.stall_s:
            return False
        log.warning("%s piece %d: claimed by %s for %.0f s and not done: reading it from the origin", entry, piece,
                    record.get("node"), self.stall_s)  # fmt: skip
        read_origin(offset, nbytes, address + offset)
        stats.refetched_bytes += nbytes
        return True

    def _fetch(
        self,
        entry: str,
        piece: int,
        peer: str,
        offset: int,
        nbytes: int,
        address: int,
        sha256: str,
        read_origin: ReadOrigin,
        stats: FillStats,
    ) -> bool:
        """Piece ``piece`` from ``peer``, checked against ``sha256``; from the origin where the peer fails."""
        where = self.etcd.get(self._key("segments", entry, peer))
        try:
            if where is None:
                raise FleetPeerError(f"{peer}: no longer in the fleet")
            self.fetcher.read(peer, json.loads(where), offset, nbytes, address + offset, sha256)
        except FleetPeerError as error:
            self.fetcher.forget(peer)
            log.warning("%s piece %d: %s; reading it from the origin", entry, piece, error)
            stats.peer_failures += 1
            read_origin(offset, nbytes, address + offset)
            if hashlib.sha256(ctypes.string_at(address + offset, nbytes)).hexdigest() != sha256:
                raise SourceChangedError(
                    f"{entry} piece {piece}: the origin's bytes no longer hash to what its claimer read"
                ) from None
            stats.refetched_bytes += nbytes
            return True
        stats.peer_bytes += nbytes
        stats.pieces_verified += 1
        return True

    def forget(self, entry: str) -> None:
        """This node no longer holds ``entry`` (evicted): peers stop looking for it here."""
        self.server.withdraw(entry)
        self.etcd.delete(self._key("complete", entry, self.node))
        self.etcd.delete(self._key("segments", entry, self.node))

    def _complete_holders(self, entry: str) -> list[str]:
        """The other nodes holding the whole entry."""
        prefix = self._key("complete", entry) + "/"
        holders = (key.removeprefix(prefix) for key in self.etcd.get_prefix(prefix))
        return sorted(holder for holder in holders if holder != self.node)

    def _check_failed(self, entry: str) -> None:
        failed = self.etcd.get(self._key("failed", entry))
        if failed is not None:
            raise SourceChangedError(f"{entry}: another node of the fleet found the origin changed: {failed.decode()}")

    def _key(self, kind: str, entry: str, name: str = "") -> str:
        return f"{self.prefix}{kind}/{entry}" + (f"/{name}" if name else "")
