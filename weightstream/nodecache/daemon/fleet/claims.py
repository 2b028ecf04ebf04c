"""Who reads which piece of an entry from the origin: one claim per piece, made in one etcd transaction (of any
number of nodes asking at once, one wins), held by the claimer's lease (a dead node's claims vanish with it), and
marked done with the piece's sha256 once the piece is in the claimer's memory, for the others to fetch and check. A
claim that stalls may be taken over by one of the nodes waiting for it (compared on its revision: one wins).

Keys: ``pieces/{entry}/{piece}`` (:class:`~weightstream.nodecache.daemon.fleet.records.Claim`).

Example:
    >>> claims = Claims(store, "node-a", lambda: member.lease)  # doctest: +SKIP
    >>> claims.claim("3f2a...", 0)  # doctest: +SKIP
    (True, Claim(node='node-a', state='claimed', sha256=None))
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from weightstream.nodecache.daemon.fleet.record_store import RecordStore
from weightstream.nodecache.daemon.fleet.records import Claim


class Claims:
    """The piece claims of node ``node`` in the fleet of ``store``, each made under the lease ``lease()`` gives at
    that moment (a node that registered again claims under its new lease)."""

    def __init__(self, store: RecordStore, node: str, lease: Callable[[], int]) -> None:
        self.store, self.node, self.lease = store, node, lease

    def claim(self, entry: str, piece: int) -> tuple[bool, Claim]:
        """Claim piece ``piece`` of ``entry`` for this node; whether it won, and the claim that holds the piece."""
        mine = Claim(self.node, "claimed")
        held = self.store.claim(entry, piece, mine, self.lease())
        return held is None, mine if held is None else held

    def take_over(self, entry: str, piece: int, revision: int) -> bool:
        """Take over the claim of ``piece`` if it is still as it was at ``revision`` (its claimer stalled); whether
        this node now holds it."""
        key = self.store.keys.claim(entry, piece)
        return self.store.etcd.replace_at(key, revision, Claim(self.node, "claimed").encode(), self.lease())

    def done(self, entry: str, piece: int, sha256: str) -> None:
        """Mark this node's claim of the piece done: it holds the piece, whose digest is ``sha256``."""
        done = Claim(self.node, "done", sha256)
        self.store.etcd.put(self.store.keys.claim(entry, piece), done.encode(), self.lease())

    def release_all(self, entry: str, pieces: Collection[int]) -> None:
        """Give up this node's claims of ``pieces`` of ``entry`` (its fill failed or was cancelled, or it evicted the
        entry) in one transaction (per ``MAX_TXN_KEYS``): the others claim them at once instead of waiting out the
        stall. A claim another node took over meanwhile is left to it."""
        if pieces:
            keys = [self.store.keys.claim(entry, piece) for piece in sorted(pieces)]
            self.store.etcd.delete_held(keys, self.lease())

    def pieces(self, entry: str) -> dict[int, tuple[Claim, int]]:
        """The claims of ``entry``'s pieces by piece number, each with the revision it last changed at."""
        return self.store.claims(entry)

    def mine(self, entry: str) -> set[int]:
        """The pieces of ``entry`` this node holds the claim of."""
        return {piece for piece, (claim, _) in self.pieces(entry).items() if claim.node == self.node}
