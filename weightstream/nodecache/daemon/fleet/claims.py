"""Who reads which piece of an entry from the origin: one claim per piece, made in one etcd transaction (of any
number of nodes asking at once, one wins), held by the claimer's lease (a dead node's claims vanish with it), and
marked done with the piece's sha256 once the piece is in the claimer's memory, for the others to fetch and check.

Keys: ``{prefix}/pieces/{entry}/{piece}`` = ``{"node": ..., "state": "claimed" | "done", "sha256": ...}``.

Example:
    >>> claims = Claims(etcd, "/weightstream", "node-a", member.lease)  # doctest: +SKIP
    >>> claims.claim("3f2a...", 0)  # doctest: +SKIP
    (True, {'node': 'node-a', 'state': 'claimed'})
"""

from __future__ import annotations

import json
from collections.abc import Collection

from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway


class Claims:
    """The piece claims of node ``node`` (its lease ``lease``) in the fleet at ``prefix``."""

    def __init__(self, etcd: EtcdGateway, prefix: str, node: str, lease: int) -> None:
        self.etcd, self.node, self.lease = etcd, node, lease
        self.pieces_prefix = f"{prefix.rstrip('/')}/pieces/"

    def claim(self, entry: str, piece: int) -> tuple[bool, dict[str, object]]:
        """Claim piece ``piece`` of ``entry`` for this node; whether it won, and the claim that holds the piece."""
        mine = {"node": self.node, "state": "claimed"}
        won, held = self.etcd.create(self._key(entry, piece), json.dumps(mine).encode(), self.lease)
        return won, mine if won else json.loads(held)

    def done(self, entry: str, piece: int, sha256: str) -> None:
        """Mark this node's claim of the piece done: it holds the piece, whose digest is ``sha256``."""
        record = {"node": self.node, "state": "done", "sha256": sha256}
        self.etcd.put(self._key(entry, piece), json.dumps(record).encode(), self.lease)

    def release(self, entry: str, piece: int) -> None:
        """Give up this node's claim of the piece (its read failed): another node may claim it."""
        key = self._key(entry, piece)
        held = self.etcd.get(key)
        if held is not None and json.loads(held).get("node") == self.node:
            self.etcd.delete(key)

    def release_all(self, entry: str, pieces: Collection[int]) -> None:
        """Give up this node's claims of ``pieces`` of ``entry`` (its fill failed or was cancelled) in one
        transaction (per ``MAX_TXN_KEYS``): the others claim them at once instead of waiting out the stall. A claim
        another node took over meanwhile is left to it."""
        if pieces:
            self.etcd.delete_held([self._key(entry, piece) for piece in sorted(pieces)], self.lease)

    def pieces(self, entry: str) -> dict[int, dict[str, object]]:
        """The claims of ``entry``'s pieces, by piece number."""
        prefix = f"{self.pieces_prefix}{entry}/"
        return {int(key.removeprefix(prefix)): json.loads(value) for key, value in self.etcd.get_prefix(prefix).items()}

    def _key(self, entry: str, piece: int) -> str:
        return f"{self.pieces_prefix}{entry}/{piece}"
