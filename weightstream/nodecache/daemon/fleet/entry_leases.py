"""Each entry's shared records, its plan (the piece size) and its pieces' digests, under a lease of the entry's own
that every node filling or holding the entry keeps alive: they outlive any one node, and they end when the last node
holding the entry evicts it or leaves (deleted then), or within ``ENTRY_TTL_S`` of the last one dying. A node keeps
the digests of what it fills and holds, and publishes them again where they ended while it was out of etcd's reach.

Keys: ``plan/{entry}`` and ``digests/{entry}/{piece}`` (:mod:`~weightstream.nodecache.daemon.fleet.records`).

Example:
    >>> entries = EntryLeases(store, "node-a")  # doctest: +SKIP
    >>> entries.plan("3f2a...", 16 << 20)  # doctest: +SKIP
    16777216
    >>> entries.publish_digest("3f2a...", 0, "9f2c...")  # doctest: +SKIP
    >>> entries.drop("3f2a...")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading

from weightstream.errors import FleetUnavailableError, logger
from weightstream.nodecache.daemon.fleet.etcd import LeaseNotFound
from weightstream.nodecache.daemon.fleet.record_store import RecordStore
from weightstream.nodecache.daemon.fleet.transfer import memory_at

log = logger(__name__)

ENTRY_TTL_S = 60
"""How long an entry's plan and digests outlive the last node that kept them alive (a node renews them with its own
lease, every third of its TTL)."""


@dataclasses.dataclass
class _Shared:
    """What this node knows of one entry's shared records."""

    lease: int
    """The lease holding them (0: a plan written without one, by an older weightstream: never renewed)."""
    piece_bytes: int
    digests: dict[int, str] = dataclasses.field(default_factory=dict)
    """Every piece digest this node checked or computed (published again where the records ended)."""


class EntryLeases:
    """The shared records of the entries node ``node`` of the fleet of ``store`` fills or holds (see the module's
    docstring). :meth:`renew` is called at each renewal of the node's own lease."""

    def __init__(self, store: RecordStore, node: str, ttl_s: int = ENTRY_TTL_S) -> None:
        self.store, self.etcd, self.keys, self.node, self.ttl_s = store, store.etcd, store.keys, node, ttl_s
        self._entries: dict[str, _Shared] = {}
        self._lock = threading.Lock()

    def plan(self, entry: str, piece_bytes: int) -> int:
        """The piece size of ``entry``: the first proposal's (``piece_bytes`` where none was made), its records'
        lease kept alive by this node from now on.

        Raises:
            FleetUnavailableError: etcd does not answer, or holds a plan that is not one (see the log).
        """
        lease = self.etcd.grant(self.ttl_s)
        try:
            agreed = self.store.propose_plan(entry, piece_bytes, lease)
        except BaseException:
            with contextlib.suppress(FleetUnavailableError):
                self._revoke(lease)
            raise
        if agreed is None or agreed[1] != lease:
            self._revoke(lease)  # another node's plan (or none that parses): its lease is the one kept alive
        if agreed is None:
            raise FleetUnavailableError(f"the fleet's plan for {entry} holds no piece size (see the log)")
        with self._lock:
            known = self._entries.get(entry)
            digests = known.digests if known is not None and known.piece_bytes == agreed[0] else {}
            self._entries[entry] = _Shared(agreed[1], agreed[0], digests)
        return agreed[0]

    def know(self, entry: str, piece: int, sha256: str) -> int | None:
        """This node checked ``piece`` of ``entry`` against ``sha256`` (it publishes it again should it end); the
        lease of the entry's records (None: this node dropped the entry meanwhile)."""
        with self._lock:
            shared = self._entries.get(entry)
            if shared is None:
                return None
            shared.digests[piece] = sha256
            return shared.lease

    def publish_digest(self, entry: str, piece: int, sha256: str) -> None:
        """Publish ``sha256`` as the digest of ``piece`` of ``entry`` (read from the origin, or corrected), where
        this node still fills or holds it."""
        lease = self.know(entry, piece, sha256)
        if lease is None:
            return
        try:
            self.etcd.put(self.keys.digest(entry, piece), sha256.encode(), lease)
        except LeaseNotFound:
            self._publish_again(entry)

    def adopt(self, entry: str, address: int, size: int, piece_bytes: int, check: bool = False) -> int:
        """Publish the records of ``entry``, held whole at ``address`` (``size`` bytes, the origin's: a segment
        adopted at start, or checked whole since): the plan (``piece_bytes`` where there is none), and unless
        ``check``, the digests the fleet has where they cover every piece; else each piece's hash of these bytes,
        published where the fleet's differs (a digest a member published for bytes that were not the origin's
        would fail every later fetch of that piece, the origin's own bytes too). How many differed.

        Raises:
            FleetUnavailableError: etcd does not answer.
        """
        agreed = self.plan(entry, piece_bytes)
        pieces = range(-(-size // agreed))
        published = self.store.digests(entry)
        if not check and all(piece in published for piece in pieces):
            with self._lock:
                self._entries[entry].digests.update({piece: published[piece] for piece in pieces})
            return 0
        corrected = 0
        for piece in pieces:
            offset = piece * agreed
            sha256 = hashlib.sha256(memory_at(address + offset, min(agreed, size - offset))).hexdigest()
            if published.get(piece) == sha256:
                self.know(entry, piece, sha256)
                continue
            if piece in published:
                log.warning("%s piece %d's digest corrected to the origin's: %s... was published", entry, piece,
                            published[piece][:16])  # fmt: skip
                corrected += 1
            self.publish_digest(entry, piece, sha256)
        return corrected

    def renew(self) -> None:
        """Keep every entry's records alive; publish again those that ended (this node was out of etcd's reach
        longer than their TTL, or the last other holder revoked them as this node joined).

        Raises:
            FleetUnavailableError: etcd does not answer.
        """
        with self._lock:
            leases = [(entry, shared.lease) for entry, shared in self._entries.items() if shared.lease]
        for entry, lease in leases:
            if self.etcd.keepalive(lease) == 0:
                log.info("fleet: %s's plan and digests had ended: published again", entry)
                self._publish_again(entry)

    def drop(self, entry: str) -> None:
        """This node no longer fills or holds ``entry``: its records are no longer kept alive here, and where no
        other node has a copy of it (whole or filling), they are deleted now.

        Raises:
            FleetUnavailableError: etcd does not answer (the records end with their lease).
        """
        with self._lock:
            shared = self._entries.pop(entry, None)
        if shared is None:
            return
        mine = self.keys.segment(entry, self.node)
        if any(key != mine for key in self.etcd.get_range(self.keys.segment(entry))):
            return
        self.etcd.delete(self.keys.plan(entry))
        self.etcd.delete_prefix(self.keys.digests(entry))
        if shared.lease:
            self._revoke(shared.lease)

    def close(self) -> None:
        """Drop every entry (the daemon leaves the fleet); what etcd does not take ends with its lease."""
        for entry in list(self._entries):
            try:
                self.drop(entry)
            except FleetUnavailableError as error:
                log.warning("fleet: %s's plan and digests not deleted (%s): they end within %d s", entry, error,
                            self.ttl_s)  # fmt: skip

    def _publish_again(self, entry: str) -> None:
        """``entry``'s records ended: the plan again (or the one another node made meanwhile), and the digests this
        node knows where the plan is the one they were taken for."""
        with self._lock:
            known = self._entries.get(entry)
        if known is None:
            return
        if self.plan(entry, known.piece_bytes) != known.piece_bytes:
            return  # another node planned it otherwise meanwhile: its digests are the ones that count
        with self._lock:
            lease = self._entries[entry].lease
        for piece, sha256 in sorted(known.digests.items()):
            self.etcd.put(self.keys.digest(entry, piece), sha256.encode(), lease)

    def _revoke(self, lease: int) -> None:
        try:
            self.etcd.revoke(lease)
        except LeaseNotFound:
            pass  # ended already
