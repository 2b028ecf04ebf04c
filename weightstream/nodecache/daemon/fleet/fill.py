"""One entry filled by a fleet: its bytes cut into pieces, each read from the origin by the one node that claims it
and fetched by every other node from a node that holds it, so the origin serves about one copy whatever the number
of nodes; a node that comes later fetches everything from peers.

Keys (under the fleet's prefix; the entry key already holds the origin's version, so versions never mix):

- ``plan/{entry}``: the entry's piece size, set by the first node to fill it (no lease: the digests depend on it);
- ``pieces/{entry}/{piece}``: the claim (``claims.py``), under the claimer's lease;
- ``digests/{entry}/{piece}``: the piece's sha256, written by the node that read it from the origin (no lease: it
  outlives that node, for every later fetch to be checked);
- ``segments/{entry}/{node}``: where ``node``'s copy of the entry is, for peers to read (under its lease);
- ``complete/{entry}/{node}``: ``node`` holds every piece (under its lease): a late joiner's source;
- ``failed/{entry}``: the origin changed (or failed for good) under a node: every node's fill ends with that error
  (under a lease of its own, ``FAILED_TTL_S``: fills under way see it, a later one tries again, and finds the change
  itself where there was one);
- ``served/{node}/{entry}/{fetcher}``: the bytes of ``entry`` that ``fetcher`` has read from ``node`` (NIXL reads are
  one-sided: the node that serves them never sees them, so its readers count them), under ``node``'s lease.

Example:
    >>> stats = FleetFill(fleet, fetcher, server).fill(entry, fd, size, read_origin)  # doctest: +SKIP
    >>> stats.bytes_from_origin, stats.bytes_from_peers  # doctest: +SKIP
    (67108864, 201326592)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import mmap
import threading
import time
from collections.abc import Callable

from weightstream.errors import FleetPeerError, FleetUnavailableError, SourceChangedError, logger
from weightstream.nodecache.daemon.fleet.claims import Claims
from weightstream.nodecache.daemon.fleet.membership import Membership
from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher, PieceServer, memory_at
from weightstream.sources.local.raw_mapping import map_file, unmap

log = logger(__name__)

PIECE_BYTES = 64 << 20
"""The largest piece: its three etcd writes (claim, digest, done) cost nothing beside moving it, and a 140 GB model is
about 2,000 pieces, which every filling node's poll of the claims reads in one range request."""
MIN_PIECE_BYTES = 8 << 20
PIECES_PER_FILE = 16
"""Files under 1 GiB are cut into about this many pieces (at least ``MIN_PIECE_BYTES`` each): peers fetch the first
pieces while the origin still serves the last, where 64 MiB pieces of a 256 MiB file all finished together."""
STALL_S = 30.0
"""A piece claimed by a node that has not finished it in this long is read from the origin by whoever waits."""
POLL_S = 0.05
FAILED_TTL_S = 60
"""How long a node's report that the origin changed ends other nodes' fills of the entry: a report without end would
keep a version that never changed (a wrong digest, a glitch) out of the fleet until someone deleted the key."""
CHECK_FAILED_S = 0.5
"""While every missing piece is moving, how often the fill looks whether another node found the origin changed."""
FETCH_THREADS = 4
"""Pieces fetched from peers at once: the agent moves one at a time, the others are checked meanwhile."""
ORIGIN_PIECES = 2
"""Pieces one node reads from the origin at once: one is hashed while the next moves, and in a storm the claims
spread over the nodes (a node claims its next piece only as one of its reads ends)."""

ReadOrigin = Callable[[int, int, int], None]
"""``read_origin(offset, nbytes, address)``: the origin's bytes ``offset..offset+nbytes`` into memory at ``address``
(pinned to the entry's version: a changed origin raises :class:`SourceChangedError`)."""


@dataclasses.dataclass
class FillStats:
    """Where one fill's bytes came from."""

    bytes_from_origin: int = 0
    bytes_from_peers: int = 0
    pieces_verified: int = 0
    """Pieces read from peers that matched their digest."""
    pieces_refetched: int = 0
    """Pieces a peer served that failed their check (or that a peer failed to serve, or whose claimer stalled), read
    from the origin again."""
    bytes_refetched: int = 0
    peer_failures: int = 0
    entries_refetched: int = 0
    """Fills whose pieces all passed their checks and the whole then failed the origin's own digest (an OCI blob's):
    read whole from the origin again."""
    bytes_from_peer_devices: int = 0
    """Of ``bytes_from_peers``, those read from a peer's device copy into this node's (GPU to GPU)."""


def piece_size(size: int) -> int:
    """The piece size a node proposes for a file of ``size`` bytes (a multiple of 1 MiB).

    Example:
        >>> [piece_size(n) >> 20 for n in (10 << 20, 256 << 20, 4 << 30)]
        [8, 16, 64]
    """
    wanted = -(-size // PIECES_PER_FILE)
    return min(PIECE_BYTES, max(MIN_PIECE_BYTES, -(-wanted >> 20) << 20))


def piece_spans(size: int, piece_bytes: int) -> list[tuple[int, int]]:
    """Each piece of a ``size``-byte file cut into ``piece_bytes``, in order: its offset and length.

    Example:
        >>> piece_spans(20 << 20, 8 << 20)
        [(0, 8388608), (8388608, 8388608), (16777216, 4194304)]
    """
    return [(offset, min(piece_bytes, size - offset)) for offset in range(0, size, piece_bytes)]


def _piece_bytes(agreed: bytes) -> int | None:
    """The piece size the fleet's plan holds; None where it holds no sensible one."""
    return int(agreed) if agreed.isdigit() and MIN_PIECE_BYTES // 8 <= int(agreed) <= 1 << 30 else None


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
    ) -> None:
        self.membership, self.fetcher, self.server = membership, fetcher, server
        self.etcd, self.node = membership.etcd, membership.node
        self.prefix = membership.nodes_prefix.removesuffix("nodes/")
        self.piece_bytes, self.stall_s = piece_bytes, stall_s
        """The piece size this node proposes for a new entry (None: :func:`piece_size`); the first proposal wins."""
        self._offered: dict[str, bytes] = {}
        """Each entry this node holds whole, and where peers read it (put again under a new lease)."""
        self._read_from: dict[tuple[str, str], int] = {}
        """Bytes this node has read from each (peer, entry), to report as the peer's ``served`` count."""
        membership.on_registered_again.append(self._offer_again)

    def fill(self, entry: str, fd: int, size: int, read_origin: ReadOrigin) -> FillStats:
        """Fill the file ``fd`` (``size`` bytes long already) with ``entry``'s bytes; where they came from.

        Raises:
            SourceChangedError: the origin changed during the fill, here or on another node (nothing is published).
            SourceError and the origin's other errors: reading a piece from the origin failed.
            FleetUnavailableError: etcd went away (the caller may fill from the origin alone).
        """
        address = map_file(fd, size, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            where = self.server.publish(entry, fd, size)
            self.etcd.put(self.key("segments", entry, self.node), json.dumps(where).encode(), self.membership.lease)
            entry_fill = _EntryFill(self, entry, address, size, read_origin)
            try:
                stats = entry_fill.run()
            finally:
                self.report_served(entry, entry_fill.read_from)
            self._offered[entry] = json.dumps(where).encode()
            self.etcd.put(self.key("complete", entry, self.node), self._offered[entry], self.membership.lease)
            return stats
        except BaseException as error:
            self.server.withdraw(entry)
            with contextlib.suppress(FleetUnavailableError):  # etcd gone: the keys go with this node's lease
                if isinstance(error, SourceChangedError):
                    self.etcd.put(self.key("failed", entry), str(error).encode(), self.etcd.grant(FAILED_TTL_S))
                self.etcd.delete(self.key("segments", entry, self.node))
            raise
        finally:
            unmap(address, size)

    def served_to_peers(self) -> dict[str, int]:
        """The bytes of each entry this node's peers have read from it (what they reported).

        Raises:
            FleetUnavailableError: etcd does not answer.
        """
        prefix = f"{self.prefix}served/{self.node}/"
        served: dict[str, int] = {}
        for key, value in self.etcd.get_prefix(prefix).items():
            entry = key.removeprefix(prefix).split("/")[0]
            if not value.isdigit():
                log.warning("fleet: %s holds %r, not a count of bytes: not counted", key, value[:40])
                continue
            served[entry] = served.get(entry, 0) + int(value)
        return served

    def report_served(self, entry: str, read_from: dict[str, tuple[int, int]]) -> None:
        """Tell each peer this fill read from (with the lease of the peer's offer, so the count goes when it does)
        how many bytes of ``entry`` it has served this node in all."""
        for peer, (nbytes, lease) in read_from.items():
            total = self._read_from[peer, entry] = self._read_from.get((peer, entry), 0) + nbytes
            try:
                self.etcd.put(f"{self.prefix}served/{peer}/{entry}/{self.node}", str(total).encode(), lease)
            except FleetUnavailableError as error:
                log.info("%s: %d bytes read from %s not reported (%s)", entry, nbytes, peer, error)

    def offer(self, entry: str, fd: int, size: int) -> None:
        """Offer ``entry``, held whole in the file ``fd`` (a segment this node had before it joined: adopted at
        start), to the fleet as a complete copy."""
        self._offered[entry] = json.dumps(self.server.publish(entry, fd, size)).encode()
        self._offer_again(self.membership.lease, [entry])

    def forget(self, entry: str) -> None:
        """This node no longer holds ``entry`` (evicted): peers stop looking for it here (etcd first, so no peer
        starts a read of it), then its NIXL registration and mapping go (a read under way fails on the reader).

        Raises:
            FleetUnavailableError: etcd was not told (the offer is withdrawn from NIXL all the same).
        """
        self._offered.pop(entry, None)
        try:
            self.etcd.delete(self.key("complete", entry, self.node))
            self.etcd.delete(self.key("segments", entry, self.node))
        finally:
            self.server.withdraw(entry)

    def _offer_again(self, lease: int, entries: list[str] | None = None) -> None:
        """Put the keys that say this node holds ``entries`` (default: all it holds) under ``lease``."""
        for entry in list(self._offered) if entries is None else entries:
            where = self._offered.get(entry)
            if where is not None:
                self.etcd.put(self.key("segments", entry, self.node), where, lease)
                self.etcd.put(self.key("complete", entry, self.node), where, lease)

    def plan(self, entry: str, size: int) -> int:
        """The piece size of ``entry`` (``size`` bytes): the one the first node to fill it chose.

        Raises:
            FleetUnavailableError: etcd does not answer, or holds a piece size that is not one (the caller fills
                from the origin alone).
        """
        proposed = self.piece_bytes or piece_size(size)
        _, agreed = self.etcd.create(self.key("plan", entry), str(proposed).encode())
        piece_bytes = _piece_bytes(agreed)
        if piece_bytes is None:
            raise FleetUnavailableError(f"the fleet's plan for {entry} says pieces of {agreed[:40]!r} bytes")
        return piece_bytes

    def agreed_plan(self, entry: str) -> int | None:
        """The piece size the fleet agreed for ``entry``; None where none was (or what is there is not one)."""
        agreed = self.etcd.get(self.key("plan", entry))
        return None if agreed is None else _piece_bytes(agreed)

    def digests(self, entry: str) -> dict[int, str]:
        """Every published piece digest of ``entry``, by piece (one range request, not one per piece)."""
        prefix = self.key("digests", entry) + "/"
        found = {}
        for key, value in self.etcd.get_prefix(prefix).items():
            piece = key.removeprefix(prefix)
            if piece.isdigit():
                found[int(piece)] = value.decode()
        return found

    def correct_digests(self, entry: str, address: int, size: int) -> int:
        """Publish the digest of each piece of ``entry`` as held at ``address`` (``size`` bytes, checked against the
        origin's own digest of the whole: they are the origin's) where the fleet's differs; how many differed. A
        digest a member published for bytes that were not the origin's would otherwise fail every later fetch of
        that piece, and the origin's own bytes too.

        Raises:
            FleetUnavailableError: etcd does not answer.
        """
        piece_bytes = self.agreed_plan(entry)
        if piece_bytes is None:
            return 0
        published, corrected = self.digests(entry), 0
        for piece, (offset, nbytes) in enumerate(piece_spans(size, piece_bytes)):
            sha256 = hashlib.sha256(memory_at(address + offset, nbytes)).hexdigest()
            if published.get(piece) not in (None, sha256):
                log.warning("%s piece %d's digest corrected to the origin's: %s... was published", entry, piece,
                            str(published[piece])[:16])  # fmt: skip
                self.etcd.put(self.key("digests", entry, str(piece)), sha256.encode())
                corrected += 1
        return corrected

    def key(self, kind: str, entry: str, name: str = "") -> str:
        """The fleet's key of ``kind`` for ``entry`` (and ``name``: a node, a piece)."""
        return f"{self.prefix}{kind}/{entry}" + (f"/{name}" if name else "")


class _EntryFill:
    """One fill of ``entry`` into memory at ``address``: which pieces are still missing, and where each comes from.
    Pieces held by peers are fetched ``FETCH_THREADS`` at a time (one moves while another is checked), pieces this
    node claims read from the origin ``ORIGIN_PIECES`` at a time, both at once."""

    def __init__(self, fleet: FleetFill, entry: str, address: int, size: int, read_origin: ReadOrigin) -> None:
        self.fleet, self.entry, self.address, self.read_origin = fleet, entry, address, read_origin
        self.spans = piece_spans(size, fleet.plan(entry, size))
        self.claims = Claims(fleet.etcd, fleet.prefix, fleet.node, fleet.membership.lease)
        self.stats = FillStats()
        self.read_from: dict[str, tuple[int, int]] = {}
        """Bytes read from each peer, and the lease of that peer's offer."""
        self._lock = threading.Lock()
        self._waiting_since: dict[int, float] = {}
        self.claimed: set[int] = set()
        """The pieces this fill holds the claim of (released together where it fails)."""

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
                    if waiting := pending - moving.keys():
                        records, holders = self.claims.pieces(self.entry), self._complete_holders()
                        digests = self.fleet.digests(self.entry) if holders else {}
                    for piece in sorted(waiting):
                        peer = self._peer_for(piece, records.get(piece), holders, digests)
                        if peer is not None:
                            moving[piece] = peers.submit(self._fetch, piece, *peer)
                        elif len(from_origin) < ORIGIN_PIECES and (why := self._origin_turn(piece, records.get(piece))):
                            moving[piece] = origin.submit(self._read_from_origin, piece, why)
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
        self, piece: int, record: dict[str, object] | None, holders: list[str], digests: dict[int, str]
    ) -> tuple[str, str] | None:
        """(peer, sha256) to fetch ``piece`` from now: a node holding the whole entry (a late joiner's way), else the
        node that read the piece from the origin; None when no peer has it yet."""
        if holders and piece in digests:
            return holders[piece % len(holders)], digests[piece]
        if record is not None and record.get("state") == "done" and record.get("node") != self.fleet.node:
            return str(record["node"]), str(record["sha256"])
        return None

    def _origin_turn(self, piece: int, record: dict[str, object] | None) -> str | None:
        """Why this node reads ``piece`` from the origin now: ``"claimed"`` (it won the claim, or holds it), or
        ``"stalled"`` (its claimer has not finished it in ``stall_s``); None: not this node's to read (yet)."""
        if record is None:
            won, record = self.claims.claim(self.entry, piece)
            if not won:
                return None
        if record.get("node") == self.fleet.node:
            self.claimed.add(piece)
            return "claimed"
        started = self._waiting_since.setdefault(piece, time.monotonic())
        if time.monotonic() - started < self.fleet.stall_s:
            return None
        log.warning("%s piece %d: claimed by %s for %.0f s and not done: reading it from the origin", self.entry,
                    piece, record.get("node"), self.fleet.stall_s)  # fmt: skip
        return "stalled"

    def _read_from_origin(self, piece: int, why: str) -> None:
        """Read ``piece`` from the origin; a claimed piece's digest is published for the others to check it by."""
        offset, nbytes = self.spans[piece]
        self.read_origin(offset, nbytes, self.address + offset)
        if why == "stalled":
            self._count(pieces_refetched=1, bytes_refetched=nbytes)
            return
        sha256 = hashlib.sha256(memory_at(self.address + offset, nbytes)).hexdigest()
        self.fleet.etcd.put(self.fleet.key("digests", self.entry, str(piece)), sha256.encode())
        self.claims.done(self.entry, piece, sha256)
        self._count(bytes_from_origin=nbytes)

    def _fetch(self, piece: int, peer: str, sha256: str) -> None:
        """``piece`` from ``peer``, checked against ``sha256``; from the origin where the peer fails."""
        offset, nbytes = self.spans[piece]
        offered = self.fleet.etcd.get_held(self.fleet.key("segments", self.entry, peer))
        try:
            if offered is None:
                raise FleetPeerError(f"{peer}: no longer in the fleet")
            where, lease = offered
            self.fleet.fetcher.read(peer, json.loads(where), offset, nbytes, self.address + offset, sha256)
        except FleetPeerError as error:
            self.fleet.fetcher.forget(peer)
            log.warning("%s piece %d: %s; reading it from the origin", self.entry, piece, error)
            self.read_origin(offset, nbytes, self.address + offset)
            if hashlib.sha256(memory_at(self.address + offset, nbytes)).hexdigest() != sha256:
                raise SourceChangedError(
                    f"{self.entry} piece {piece}: the origin's bytes no longer hash to what its claimer read"
                ) from None
            self._count(peer_failures=1, pieces_refetched=1, bytes_refetched=nbytes)
            return
        self._count(bytes_from_peers=nbytes, pieces_verified=1)
        with self._lock:
            self.read_from[peer] = (self.read_from.get(peer, (0, 0))[0] + nbytes, lease)

    def _count(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    def _complete_holders(self) -> list[str]:
        """The other nodes holding the whole entry."""
        prefix = self.fleet.key("complete", self.entry) + "/"
        holders = (key.removeprefix(prefix) for key in self.fleet.etcd.get_prefix(prefix))
        return sorted(holder for holder in holders if holder != self.fleet.node)

    def _check_failed(self) -> None:
        failed = self.fleet.etcd.get(self.fleet.key("failed", self.entry))
        if failed is not None:
            raise SourceChangedError(
                f"{self.entry}: another node of the fleet found the origin changed: {failed.decode()}"
            )
