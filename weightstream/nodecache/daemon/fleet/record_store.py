"""The fleet's records in etcd, read as typed records (:mod:`~weightstream.nodecache.daemon.fleet.records`) and
written in their one encoding. A key or value that does not parse is skipped and counted (``bad_records``, shown by
``stats`` as ``fleet.bad_records``), and its key logged once, escaped: a broken or hostile member's writes never
fail a load here, they only leave this node less to fetch from peers.

Example:
    >>> store = RecordStore(etcd, "/weightstream")  # doctest: +SKIP
    >>> store.claims("3f2a...")  # doctest: +SKIP
    {0: Claim(node='node-a', state='done', sha256='9f2c...')}
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from weightstream.errors import logger
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway, Held
from weightstream.nodecache.daemon.fleet.records import (
    Claim,
    FleetKeys,
    NodeRecord,
    Offer,
    UnparsableRecord,
    parse_claim,
    parse_digest,
    parse_node,
    parse_offer,
    parse_plan,
    parse_reason,
)

log = logger(__name__)

Record = TypeVar("Record")
UNPARSABLE_CLAIM = Claim("", "unparsable")
"""What a claim that does not parse reads as: held by no node, never done."""
MAX_LOGGED = 1000
"""Bad keys remembered (each logged once); past that, a bad key is counted, not logged."""


class RecordStore:
    """The records under ``prefix`` in ``etcd``, typed (see the module's docstring)."""

    def __init__(self, etcd: EtcdGateway, prefix: str) -> None:
        self.etcd, self.keys = etcd, FleetKeys(prefix)
        self.bad_records = 0
        """Keys and values skipped because they did not parse, since this store was made."""
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def skip(self, key: str, why: str) -> None:
        """Count ``key`` as a record that does not parse (``why``), logged the first time it is seen."""
        with self._lock:
            self.bad_records += 1
            first = key not in self._logged and len(self._logged) < MAX_LOGGED
            if first:
                self._logged.add(key)
        if first:
            log.warning("fleet: %s skipped: %s", ascii(key)[:300], why)

    def parsed(self, key: str, value: bytes, parse: Callable[[bytes], Record]) -> Record | None:
        """``value`` (of ``key``) parsed by ``parse``; None, counted, where it does not parse."""
        try:
            return parse(value)
        except UnparsableRecord as error:
            self.skip(key, str(error))
            return None

    def _range(
        self, under: str, count: int, parse: Callable[[bytes], Record]
    ) -> dict[tuple[str, ...], tuple[Record, Held]]:
        """The keys under ``under`` of ``count`` names whose values parse: by their names, each record as parsed and
        as read."""
        found = {}
        for key, held in self.etcd.get_range(under).items():
            try:
                found[FleetKeys.names(under, key, count)] = (parse(held.value), held)
            except UnparsableRecord as error:
                self.skip(key, str(error))
        return found

    def _pieces(
        self, under: str, parse: Callable[[bytes], Record], unparsable: Record | None = None
    ) -> dict[int, tuple[Record, Held]]:
        """As :meth:`_range` for keys named by a piece number (claims, digests), by piece; a piece's value that does
        not parse is counted and, where ``unparsable`` is given, handed back as that."""
        found = {}
        for key, held in self.etcd.get_range(under).items():
            try:
                piece = FleetKeys.piece(under, key)
            except UnparsableRecord as error:
                self.skip(key, str(error))
                continue
            record = self.parsed(key, held.value, parse)
            if record is None:
                if unparsable is None:
                    continue
                record = unparsable
            found[piece] = (record, held)
        return found

    def nodes(self) -> dict[str, NodeRecord]:
        """The live nodes, by name."""
        return {names[0]: node for names, (node, _) in self._range(self.keys.node(), 1, parse_node).items()}

    def claims(self, entry: str) -> dict[int, tuple[Claim, int]]:
        """The claims of ``entry``'s pieces by piece: each claim, and the revision it was last changed at. A claim
        that does not parse is :data:`UNPARSABLE_CLAIM` (counted): it holds its piece like a claim that stalls, until
        a waiting node takes it over on its revision (skipping it would leave the piece unclaimable for ever)."""
        claims = self._pieces(self.keys.claims(entry), parse_claim, UNPARSABLE_CLAIM)
        return {piece: (claim, held.revision) for piece, (claim, held) in claims.items()}

    def claim(self, entry: str, piece: int, claim: Claim, lease: int) -> Claim | None:
        """Claim ``piece`` of ``entry`` (None: this call won), else the claim that holds it (None where that does
        not parse: counted, and the piece is not this node's to read)."""
        held = self.etcd.create(self.keys.claim(entry, piece), claim.encode(), lease)
        if held is None:
            return None
        return self.parsed(self.keys.claim(entry, piece), held.value, parse_claim) or UNPARSABLE_CLAIM

    def digests(self, entry: str) -> dict[int, str]:
        """Every published piece digest of ``entry``, by piece (one range request)."""
        return {piece: sha256 for piece, (sha256, _) in self._pieces(self.keys.digests(entry), parse_digest).items()}

    def plan(self, entry: str) -> int | None:
        """The piece size the fleet agreed for ``entry``; None where none was (or what is there does not parse)."""
        key = self.keys.plan(entry)
        value = self.etcd.get(key)
        return None if value is None else self.parsed(key, value, parse_plan)

    def propose_plan(self, entry: str, piece_bytes: int, lease: int) -> tuple[int, int] | None:
        """Propose pieces of ``piece_bytes`` for ``entry``, under ``lease``; the agreed size (the first proposal's)
        and the lease that holds it (``lease`` where this proposal was the first), None where what etcd holds does
        not parse."""
        key = self.keys.plan(entry)
        held = self.etcd.create(key, str(piece_bytes).encode(), lease)
        if held is None:
            return piece_bytes, lease
        agreed = self.parsed(key, held.value, parse_plan)
        return None if agreed is None else (agreed, held.lease)

    def offer(self, key: str) -> tuple[Offer, int] | None:
        """The offer at ``key`` (a segment's, a whole copy's or a device copy's) and its lease; None where there is
        none, or it does not parse."""
        held = self.etcd.get_held(key)
        if held is None:
            return None
        offer = self.parsed(key, held[0], parse_offer)
        return None if offer is None else (offer, held[1])

    def holders(self, entry: str) -> list[str]:
        """The nodes whose ``complete/`` offer of ``entry`` parses, sorted."""
        return sorted(names[0] for names in self._range(self.keys.complete(entry), 1, parse_offer))

    def device_offers(self, entry: str) -> list[tuple[str, Offer, int]]:
        """Every device copy of ``entry`` offered (node, offer, the lease of the offer), sorted by key."""
        offers = self._range(self.keys.device(entry), 2, parse_offer)
        return [(names[0], offers[names][0], offers[names][1].lease) for names in sorted(offers)]

    def failed(self, entry: str) -> str | None:
        """Why a node found ``entry``'s origin changed, where one did."""
        value = self.etcd.get(self.keys.failed(entry))
        return None if value is None else parse_reason(value)

    def offered(self) -> tuple[set[tuple[str, ...]], set[tuple[str, ...]], set[tuple[str, ...]]]:
        """Every (entry, node) offered as a segment and as a whole copy, and every (entry, node, gpu) device copy."""
        segments = set(self._range(self.keys.family("segments"), 2, parse_offer))
        complete = set(self._range(self.keys.family("complete"), 2, parse_offer))
        return segments, complete, set(self._range(self.keys.family("devices"), 3, parse_offer))
