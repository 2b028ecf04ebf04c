"""One entry filled by a fleet: its bytes cut into pieces, each read from the origin by the one node that claims it
and fetched by every other node from a node that holds it, so the origin serves about one copy whatever the number
of nodes; a node that comes later fetches everything from peers.

Keys: ``plan/``, ``pieces/``, ``digests/``, ``segments/``, ``complete/`` and ``failed/`` of the entry
(:mod:`~weightstream.nodecache.daemon.fleet.records` says what each holds, and for how long).

Example:
    >>> stats = FleetFill(fleet, fetcher, server).fill(entry, fd, size, read_origin)  # doctest: +SKIP
    >>> stats.bytes_from_origin, stats.bytes_from_peers  # doctest: +SKIP
    (67108864, 201326592)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import mmap
import threading
import time
from collections.abc import Callable

from weightstream.errors import FleetPeerError, FleetUnavailableError, SourceChangedError, logger
from weightstream.nodecache.daemon.fleet.claims import Claims
from weightstream.nodecache.daemon.fleet.entry_leases import ENTRY_TTL_S, EntryLeases
from weightstream.nodecache.daemon.fleet.membership import Membership
from weightstream.nodecache.daemon.fleet.pieces import FillStats, fill_deadline, piece_size, piece_spans
from weightstream.nodecache.daemon.fleet.records import Claim, Offer
from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher, PieceServer, memory_at
from weightstream.sources.local.raw_mapping import map_file, unmap, unmap_around

log = logger(__name__)

STALL_S = 30.0
"""A piece claimed by a node that has not finished it in this long is read from the origin by whoever waits."""
POLL_S = 0.05
FAILED_TTL_S = 60
"""How long a node's report that the origin changed ends other nodes' fills of the entry: a report without end would
keep a version that never changed (a wrong digest, a glitch) out of the fleet until someone deleted the key."""
CHECK_FAILED_S = 0.5
"""While every missing piece is moving, how often the fill looks whether another node found the origin changed."""
FETCH_THREADS = 4
"""Pieces fetched from peers at once, each its own transfer with its own deadline (a peer that does not answer
costs one deadline per fill, not one per piece)."""
ORIGIN_PIECES = 2
"""Pieces one node reads from the origin at once: one is hashed while the next moves, and in a storm the claims
spread over the nodes (a node claims its next piece only as one of its reads ends)."""

ReadOrigin = Callable[[int, int, int], None]
"""``read_origin(offset, nbytes, address)``: the origin's bytes ``offset..offset+nbytes`` into memory at ``address``
(pinned to the entry's version: a changed origin raises :class:`SourceChangedError`)."""


class FleetFill:
    """Fills entries with the fleet this node is a member of (``membership``), reading pieces from peers with
    ``fetcher`` and offering its own with ``server``."""

    def __init__(
        self,
        membership: Membership,
        fetcher: PieceFetcher,
        server: PieceServer,
        piece_bytes: int | None = None,
        stall_s: float = STALL_S,
        deadline: Callable[[int], float] = fill_deadline,
        entry_ttl_s: int = ENTRY_TTL_S,
    ) -> None:
        self.membership, self.fetcher, self.server = membership, fetcher, server
        self.store, self.etcd, self.node = membership.store, membership.etcd, membership.node
        self.keys = self.store.keys
        self.piece_bytes, self.stall_s, self.deadline = piece_bytes, stall_s, deadline
        """The piece size this node proposes for a new entry (None: :func:`piece_size`; the first proposal wins), how
        long a claim may stall, and how long a fill of a given size waits for peers."""
        self._offered: dict[str, Offer] = {}
        """Each entry this node holds whole, and where peers read it (put again under a new lease)."""
        self.entries = EntryLeases(self.store, self.node, entry_ttl_s)
        """The plan and digests of what this node fills and holds, kept alive with its lease."""
        membership.on_registered_again.append(self._offer_again)
        membership.renewals.append(self.entries.renew)
        membership.renewals.append(self.served_to_peers)  # the notices collected: they wait in the agent till then
        membership.renewals.append(fetcher.reap)  # transfers kept out of use: released once they are seen to end

    def fill(self, entry: str, fd: int, size: int, read_origin: ReadOrigin) -> FillStats:
        """Fill the file ``fd`` (``size`` bytes long already) with ``entry``'s bytes; where they came from.

        Raises:
            SourceChangedError: the origin changed during the fill, here or on another node (nothing is published).
            SourceError and the origin's other errors: reading a piece from the origin failed.
            FleetUnavailableError: etcd went away (the caller may fill from the origin alone).
            MemoryStillInUseError: a peer's transfer into ``fd``'s memory could not be stopped: fill a fresh file.
        """
        address = map_file(fd, size, mmap.PROT_READ | mmap.PROT_WRITE)
        entry_fill = None
        try:
            where = self.server.publish(entry, fd, size)
            self.etcd.put(self.keys.segment(entry, self.node), where.encode(), self.membership.lease)
            entry_fill = _EntryFill(self, entry, address, size, read_origin)
            stats = entry_fill.run()
            self._offered[entry] = where
            self.etcd.put(self.keys.complete(entry, self.node), where.encode(), self.membership.lease)
            return stats
        except BaseException as error:
            self.server.withdraw(entry)
            with contextlib.suppress(FleetUnavailableError):  # etcd gone: the keys go with this node's lease
                seen_here = entry_fill is None or entry_fill.reported_by is None
                if isinstance(error, SourceChangedError) and seen_here:  # only a node that saw it reports it
                    self.etcd.put(self.keys.failed(entry), str(error).encode(), self.etcd.grant(FAILED_TTL_S))
                self.etcd.delete(self.keys.segment(entry, self.node))
                self.entries.drop(entry)
            raise
        finally:
            unmap_around(address, size, self.fetcher.stuck)  # what a transfer may still write stays mapped
            self.fetcher.hand_over(address, size)  # ... until that transfer is seen to end

    def served_to_peers(self) -> dict[str, int]:
        """The bytes of each entry this node's peers have read from it, as their agents told this node's
        (:meth:`PieceServer.served`: nothing in etcd)."""
        return self.server.served()

    def offer(self, entry: str, fd: int, size: int, check: bool = False) -> int:
        """Offer ``entry``, held whole in the file ``fd`` (the origin's bytes: a segment this node had before it
        joined, adopted at start, or one checked whole since) to the fleet as a complete copy, with its plan and
        digests (with ``check``, every digest taken from these bytes: see :meth:`EntryLeases.adopt`); how many
        published digests differed from these bytes.

        Raises:
            FleetUnavailableError: etcd does not answer.
        """
        address = map_file(fd, size, mmap.PROT_READ)
        try:
            corrected = self.entries.adopt(entry, address, size, self.piece_bytes or piece_size(size), check)
        finally:
            unmap(address, size)
        self._offered[entry] = self.server.publish(entry, fd, size)
        self._offer_again(self.membership.lease, [entry])
        return corrected

    def forget(self, entry: str) -> None:
        """This node no longer holds ``entry`` (evicted): peers stop looking for it here (etcd first, so no peer
        starts a read of it: its offers, then its claims, whose pieces another node now reads from the origin), then
        its NIXL registration and mapping go (a read under way fails on the reader).

        Raises:
            FleetUnavailableError: etcd was not told (the offer is withdrawn from NIXL all the same).
        """
        self._offered.pop(entry, None)
        try:
            self.etcd.delete(self.keys.complete(entry, self.node))
            self.etcd.delete(self.keys.segment(entry, self.node))
            claims = Claims(self.store, self.node, lambda: self.membership.lease)
            claims.release_all(entry, claims.mine(entry))
            self.entries.drop(entry)
        finally:
            self.server.withdraw(entry)

    def close(self) -> None:
        """Leave: the plan and digests of what only this node holds are deleted (the rest stay its peers')."""
        self.entries.close()

    def _offer_again(self, lease: int, entries: list[str] | None = None) -> None:
        """Put the keys that say this node holds ``entries`` (default: all it holds) under ``lease``."""
        for entry in list(self._offered) if entries is None else entries:
            where = self._offered.get(entry)
            if where is not None:
                self.etcd.put(self.keys.segment(entry, self.node), where.encode(), lease)
                self.etcd.put(self.keys.complete(entry, self.node), where.encode(), lease)

    def plan(self, entry: str, size: int) -> int:
        """The piece size of ``entry`` (``size`` bytes): the one the first node to fill it chose.

        Raises:
            FleetUnavailableError: etcd does not answer, or holds a piece size that is not one (the caller fills
                from the origin alone).
        """
        return self.entries.plan(entry, self.piece_bytes or piece_size(size))

    def correct_digest(self, entry: str, piece: int, published: str, sha256: str) -> None:
        """Publish ``sha256`` (of the origin's own bytes) as ``piece``'s digest where ``published`` was."""
        log.warning("%s piece %d's digest corrected to the origin's: %s... was published", entry, piece, published[:16])
        self.entries.publish_digest(entry, piece, sha256)


class _EntryFill:
    """One fill of ``entry`` into memory at ``address``: which pieces are still missing, and where each comes from.
    Pieces held by peers are fetched ``FETCH_THREADS`` at a time (one moves while another is checked), pieces this
    node claims read from the origin ``ORIGIN_PIECES`` at a time, both at once. A peer that fails once serves this
    fill nothing more (its pieces come from another holder, else the origin)."""

    def __init__(self, fleet: FleetFill, entry: str, address: int, size: int, read_origin: ReadOrigin) -> None:
        self.fleet, self.entry, self.address, self.read_origin = fleet, entry, address, read_origin
        self.spans = piece_spans(size, fleet.plan(entry, size))
        self.claims = Claims(fleet.store, fleet.node, lambda: fleet.membership.lease)
        self.stats = FillStats()
        self._lock = threading.Lock()
        self._waiting_since: dict[int, float] = {}
        self.claimed: set[int] = set()
        """The pieces this fill holds the claim of (released together where it fails)."""
        self.failed_peers: set[str] = set()
        """Peers that failed this fill once: asked for nothing more in it."""
        self.reported_by: str | None = None
        """Another node's report that the origin changed, where that is what ended this fill (not re-reported)."""
        self.deadline = time.monotonic() + fleet.deadline(size)
        """Past this, nothing more is asked of peers or waited for from claimers: the rest comes from the origin."""
        self.late = False

    def run(self) -> FillStats:
        """Fill every piece; where anything fails (the origin, a cancel at shutdown, etcd), this node's claims of the
        entry are released in one transaction before the error goes on: no node waits out a stall for them.

        Raises:
            SourceChangedError, SourceError, CacheUnavailableError, FleetUnavailableError: as the pieces' reads and
                etcd raise them.
        """
        try:
            return self._run()
        except BaseException as error:
            try:
                self.claims.release_all(self.entry, self.claimed)
            except FleetUnavailableError as unreachable:
                log.warning("%s: the failed fill's claims not released (%s): they go with this node's lease",
                            self.entry, unreachable)  # fmt: skip
            else:
                if self.claimed:
                    log.info("%s: %d claims released (%s)", self.entry, len(self.claimed), type(error).__name__)
            raise

    def _run(self) -> FillStats:
        pending = set(range(len(self.spans)))
        moving: dict[int, concurrent.futures.Future[None]] = {}
        from_origin: set[int] = set()
        peers = concurrent.futures.ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="weightstream-fleet")
        origin = concurrent.futures.ThreadPoolExecutor(ORIGIN_PIECES, thread_name_prefix="weightstream-fleet-claimed")
        with peers, origin:
            try:
                while pending:
                    self._check_failed()
                    self._check_deadline(len(pending - moving.keys()))
                    if waiting := pending - moving.keys():
                        records, holders = self.claims.pieces(self.entry), self._complete_holders()
                        digests = self.fleet.store.digests(self.entry) if holders else {}
                    for piece in sorted(waiting):
                        record = records.get(piece)
                        peer = self._peer_for(piece, record and record[0], holders, digests)
                        if peer is not None:
                            moving[piece] = peers.submit(self._fetch, piece, *peer)
                        elif len(from_origin) < ORIGIN_PIECES and (why := self._origin_turn(piece, record)):
                            moving[piece] = origin.submit(self._read_from_origin, piece, why, record and record[0])
                            from_origin.add(piece)
                    if not moving:
                        time.sleep(POLL_S)
                        continue
                    # Pieces waiting on others: look again soon; all moving: wake when one lands (or to check failed).
                    done, _ = concurrent.futures.wait(
                        moving.values(),
                        timeout=POLL_S if pending - moving.keys() else CHECK_FAILED_S,
                        return_when=concurrent.futures.FIRST_COMPLETED,
                    )
                    for piece in [piece for piece, future in moving.items() if future in done]:
                        moving.pop(piece).result()
                        pending.discard(piece)
                        from_origin.discard(piece)
            finally:
                for future in moving.values():
                    future.cancel()
        self._check_failed()  # a node that found the origin changed while this one finished: nothing is published
        return self.stats

    def _peer_for(
        self, piece: int, claim: Claim | None, holders: list[str], digests: dict[int, str]
    ) -> tuple[str, str] | None:
        """(peer, sha256) to fetch ``piece`` from now: a node holding the whole entry (a late joiner's way), else the
        node that read the piece from the origin; None when no peer (that has not failed this fill) has it yet."""
        if self.late:
            return None
        holders = [holder for holder in holders if holder not in self.failed_peers]
        if holders and piece in digests:
            return holders[piece % len(holders)], digests[piece]
        if claim is not None and claim.state == "done" and claim.node not in (self.fleet.node, *self.failed_peers):
            return claim.node, str(claim.sha256)
        return None

    def _origin_turn(self, piece: int, record: tuple[Claim, int] | None) -> str | None:
        """Why this node reads ``piece`` from the origin now: ``"claimed"`` (it won the claim, holds it, or took over
        a claim stalled for ``stall_s``), ``"refetched"`` (the piece is done, on a peer that failed this fill),
        ``"late"`` (the fill's deadline passed: whoever claimed it); None: not this node's to read (yet)."""
        if record is None:
            won, claim = self.claims.claim(self.entry, piece)
            if not won and not self.late:
                return None
        else:
            claim = record[0]
        if claim.node == self.fleet.node:
            self.claimed.add(piece)
            return "claimed"
        if self.late:
            return "late"
        if claim.state == "done":
            return "refetched" if claim.node in self.failed_peers else None
        started = self._waiting_since.setdefault(piece, time.monotonic())
        if record is None or time.monotonic() - started < self.fleet.stall_s:
            return None
        self._waiting_since.pop(piece)
        if not self.claims.take_over(self.entry, piece, record[1]):
            return None  # the claimer finished, or another node took it over: look again
        log.warning("%s piece %d: claimed by %s for %.0f s and not done: claimed here, read from the origin",
                    self.entry, piece, claim.node, self.fleet.stall_s)  # fmt: skip
        self.claimed.add(piece)
        self._count(claims_taken_over=1)
        return "claimed"

    def _read_from_origin(self, piece: int, why: str, claim: Claim | None) -> None:
        """Read ``piece`` from the origin; a claimed piece's digest is published for the others to check it by (a
        done piece's is checked, and corrected where the origin's bytes say otherwise)."""
        offset, nbytes = self.spans[piece]
        self.read_origin(offset, nbytes, self.address + offset)
        sha256 = hashlib.sha256(memory_at(self.address + offset, nbytes)).hexdigest()
        if why != "claimed":
            self.fleet.entries.know(self.entry, piece, sha256)
            if why == "refetched":
                self._count(pieces_refetched=1, bytes_refetched=nbytes)
            else:
                self._count(pieces_past_deadline=1, bytes_from_origin=nbytes)
            if claim is not None and claim.sha256 not in (None, sha256):
                self._correct(piece, str(claim.sha256), sha256)
            return
        self.fleet.entries.publish_digest(self.entry, piece, sha256)
        self.claims.done(self.entry, piece, sha256)
        self._count(bytes_from_origin=nbytes)

    def _fetch(self, piece: int, peer: str, sha256: str) -> None:
        """``piece`` from ``peer``, checked against ``sha256``; from the origin where the peer fails (the peer then
        serves this fill nothing more)."""
        offset, nbytes = self.spans[piece]
        try:
            offered = self.fleet.store.offer(self.fleet.keys.segment(self.entry, peer))
            if offered is None:
                raise FleetPeerError(f"{peer}: no longer offers it")
            self.fleet.fetcher.read(
                peer, offered[0], offset, nbytes, self.address + offset, sha256, served_as=self.entry
            )
        except FleetPeerError as error:
            with self._lock:
                self.failed_peers.add(peer)
            self.fleet.fetcher.forget(peer)
            log.warning("%s piece %d: %s; reading it from the origin (and nothing more from %s in this fill)",
                        self.entry, piece, error, peer)  # fmt: skip
            self.read_origin(offset, nbytes, self.address + offset)
            origin = hashlib.sha256(memory_at(self.address + offset, nbytes)).hexdigest()
            self.fleet.entries.know(self.entry, piece, origin)
            if origin != sha256:
                self._correct(piece, sha256, origin)
            self._count(peer_failures=1, pieces_refetched=1, bytes_refetched=nbytes)
            return
        self.fleet.entries.know(self.entry, piece, sha256)
        self._count(bytes_from_peers=nbytes, pieces_verified=1)

    def _correct(self, piece: int, published: str, sha256: str) -> None:
        """The origin's own bytes of ``piece`` (read pinned to the entry's version: a changed origin raises) hash to
        ``sha256``, not to the ``published`` digest: the digest is wrong, not the origin. Publish the origin's."""
        self.fleet.correct_digest(self.entry, piece, published, sha256)
        self._count(digests_corrected=1)

    def _count(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    def _complete_holders(self) -> list[str]:
        """The other nodes holding the whole entry."""
        return [holder for holder in self.fleet.store.holders(self.entry) if holder != self.fleet.node]

    def _check_deadline(self, waiting: int) -> None:
        """Past the fill's deadline, the pieces still ``waiting`` come from the origin (logged once)."""
        if not self.late and waiting and time.monotonic() > self.deadline:
            self.late = True
            log.warning("%s: the fill's deadline passed with %d pieces still to come from peers and claimers: "
                        "reading them from the origin", self.entry, waiting)  # fmt: skip

    def _check_failed(self) -> None:
        reason = self.fleet.store.failed(self.entry)
        if reason is not None:
            self.reported_by = reason
            raise SourceChangedError(f"{self.entry}: another node of the fleet found the origin changed: {reason}")
