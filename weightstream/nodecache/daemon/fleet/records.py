"""The fleet's key schema: every key the fleet writes in etcd, and every value it reads back, parsed into a typed
record. Anyone who can write the fleet's prefix (any member, a broken or hostile one included) can put anything
there: a value or a key name that does not parse raises :class:`UnparsableRecord` here, and the readers
(:mod:`~weightstream.nodecache.daemon.fleet.record_store`) skip and count it, so no ``JSONDecodeError``,
``KeyError``, ``TypeError`` or ``UnicodeDecodeError`` ever reaches a user's load.

Keys (under the fleet's prefix; ``entry`` is a segment key, which holds the origin's version: versions never mix):

- ``nodes/{node}``: a live node, :class:`NodeRecord` (under its lease);
- ``plan/{entry}``: the entry's piece size in bytes (decimal), set by the first node to fill it, under the entry's
  own lease, which every node filling or holding the entry keeps alive
  (:mod:`~weightstream.nodecache.daemon.fleet.entry_leases`): deleted by the last holder to evict it or leave;
- ``pieces/{entry}/{piece}``: a :class:`Claim` (under the claimer's lease);
- ``digests/{entry}/{piece}``: the piece's sha256 (hex), published by the node that read it from the origin, under
  the entry's lease (as ``plan/``: it outlives that node, for every later fetch to be checked, and ends with the
  entry's last holder);
- ``segments/{entry}/{node}``: an :class:`Offer`: where ``node``'s copy of the entry is (whole or filling);
- ``complete/{entry}/{node}``: the same :class:`Offer` once ``node`` holds every piece: a late joiner's source;
- ``devices/{entry}/{node}/{gpu}``: an :class:`Offer` of ``node``'s device copy on GPU ``gpu``;
- ``failed/{entry}``: why the node that saw it found the origin changed (text, under a lease of its own).

(``bytes_served_to_peers`` travels in NIXL's own notifications of each read, not in etcd.)

Example:
    >>> keys = FleetKeys("/weightstream")
    >>> keys.claim("3f2a", 7)
    '/weightstream/pieces/3f2a/7'
    >>> keys.names(keys.claims("3f2a"), "/weightstream/pieces/3f2a/7", 1)
    ('7',)
    >>> parse_claim(b'{"node": "node-a", "state": "claimed"}')
    Claim(node='node-a', state='claimed', sha256=None)
    >>> parse_claim(b'{"node": "node-a", "state": "done"}')
    Traceback (most recent call last):
    ...
    weightstream.nodecache.daemon.fleet.records.UnparsableRecord: a done claim without a sha256
"""

from __future__ import annotations

import dataclasses
import json
import re

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
"""A name inside a key (a node, an entry, a GPU): a host name's characters, so a name never adds a level to a path."""
SHA256 = re.compile(r"[0-9a-f]{64}")
HOME = re.compile(r"[0-9a-f]{32}")
MIN_PIECE_BYTES, MAX_PIECE_BYTES = 1 << 20, 1 << 30
"""The piece sizes a plan may hold (a node proposes 8-64 MiB): anything else is not a plan."""
MEMORY_KINDS = ("DRAM", "VRAM")
"""What a node offers: host memory (segments) and device memory (device copies)."""
MAX_METADATA_HEX = 1 << 20
"""The longest NIXL agent metadata an offer may carry (an agent's is a few KiB)."""
MAX_REASON = 2000
"""The most of a ``failed/`` report's text a node reads (and repeats in its error)."""


class UnparsableRecord(ValueError):
    """A key or a value in the fleet's prefix is not what the schema says (the reason, without the value)."""


@dataclasses.dataclass(frozen=True)
class Claim:
    """Who reads a piece from the origin (``claimed``), and once it did, the piece's digest (``done``)."""

    node: str
    state: str
    sha256: str | None = None

    def encode(self) -> bytes:
        record = {"node": self.node, "state": self.state}
        return json.dumps(record if self.sha256 is None else {**record, "sha256": self.sha256}).encode()


@dataclasses.dataclass(frozen=True)
class Offer:
    """Where a node's copy is, for a peer's NIXL agent to read it: its address and size, the kind of memory (and the
    device), the agent metadata (hex) that reaches this registration, and the GPU of a device copy."""

    address: int
    size: int
    memory: str
    device: int
    metadata: str
    gpu: str | None = None

    def encode(self) -> bytes:
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v is not None}).encode()


@dataclasses.dataclass(frozen=True)
class NodeRecord:
    """A live node as it registered: its name (what ``cache fleet`` shows; the key's lease says who holds it) and
    its home, a digest of its host and cache directory (a daemon restarted on that directory is the same node)."""

    node: str
    home: str = ""

    def encode(self) -> bytes:
        return json.dumps({"node": self.node, **({"home": self.home} if self.home else {})}).encode()


def _object(value: bytes) -> dict[str, object]:
    try:
        record = json.loads(value.decode("utf-8"))
    except (ValueError, RecursionError):
        raise UnparsableRecord("not JSON") from None
    if not isinstance(record, dict):
        raise UnparsableRecord(f"a JSON {type(record).__name__}, not an object")
    return record


def _integer(record: dict[str, object], field: str, low: int, high: int) -> int:
    value = record.get(field)
    if type(value) is not int or not low <= value <= high:
        raise UnparsableRecord(f"{field} is not an integer in {low}..{high}")
    return value


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise UnparsableRecord(f"{what} is not a name")
    return value


def _decimal(value: bytes, low: int, high: int) -> int:
    if not value.isdigit() or len(value) > 20 or not low <= int(value) <= high:
        raise UnparsableRecord(f"not a decimal in {low}..{high}")
    return int(value)


def parse_claim(value: bytes) -> Claim:
    """A ``pieces/`` value as a :class:`Claim`."""
    record = _object(value)
    node, state, sha256 = _name(record.get("node"), "node"), record.get("state"), record.get("sha256")
    if state not in ("claimed", "done"):
        raise UnparsableRecord("state is neither claimed nor done")
    if state == "done" and sha256 is None:
        raise UnparsableRecord("a done claim without a sha256")
    if sha256 is not None and not (isinstance(sha256, str) and SHA256.fullmatch(sha256)):
        raise UnparsableRecord("sha256 is not 64 hex digits")
    return Claim(node, str(state), sha256)


def parse_offer(value: bytes) -> Offer:
    """A ``segments/``, ``complete/`` or ``devices/`` value as an :class:`Offer`."""
    record = _object(value)
    memory, metadata, gpu = record.get("memory", "DRAM"), record.get("metadata"), record.get("gpu")
    if memory not in MEMORY_KINDS:
        raise UnparsableRecord(f"memory is not one of {', '.join(MEMORY_KINDS)}")
    if not isinstance(metadata, str) or len(metadata) > MAX_METADATA_HEX or len(metadata) % 2:
        raise UnparsableRecord("metadata is not hex")
    try:
        bytes.fromhex(metadata)
    except ValueError:
        raise UnparsableRecord("metadata is not hex") from None
    return Offer(
        address=_integer(record, "address", 0, (1 << 64) - 1),
        size=_integer(record, "size", 0, 1 << 50),
        memory=str(memory),
        device=_integer(record, "device", 0, 1 << 16) if "device" in record else 0,
        metadata=metadata,
        gpu=None if gpu is None else _name(gpu, "gpu"),
    )


def parse_node(value: bytes) -> NodeRecord:
    """A ``nodes/`` value as a :class:`NodeRecord`."""
    record = _object(value)
    home = record.get("home", "")
    if not isinstance(home, str) or (home and not HOME.fullmatch(home)):
        raise UnparsableRecord("home is not 32 hex digits")
    return NodeRecord(_name(record.get("node"), "node"), home)


def parse_digest(value: bytes) -> str:
    """A ``digests/`` value: a sha256 as 64 lowercase hex digits."""
    if not SHA256.fullmatch(value.decode("ascii", "replace")):
        raise UnparsableRecord("not a sha256 (64 hex digits)")
    return value.decode("ascii")


def parse_plan(value: bytes) -> int:
    """A ``plan/`` value: a piece size in bytes."""
    return _decimal(value, MIN_PIECE_BYTES, MAX_PIECE_BYTES)


def parse_reason(value: bytes) -> str:
    """A ``failed/`` value: text (what is not UTF-8 replaced, at most ``MAX_REASON`` characters)."""
    return value[: MAX_REASON * 4].decode("utf-8", "replace")[:MAX_REASON]


class FleetKeys:
    """The paths of the fleet's keys under ``prefix``; a method without its last argument gives the prefix under
    which every such key is (for a range read)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.rstrip("/") + "/"

    def node(self, node: str = "") -> str:
        return f"{self.prefix}nodes/{node}"

    def plan(self, entry: str) -> str:
        return f"{self.prefix}plan/{entry}"

    def claims(self, entry: str) -> str:
        return f"{self.prefix}pieces/{entry}/"

    def claim(self, entry: str, piece: int) -> str:
        return f"{self.claims(entry)}{piece}"

    def digests(self, entry: str) -> str:
        return f"{self.prefix}digests/{entry}/"

    def digest(self, entry: str, piece: int) -> str:
        return f"{self.digests(entry)}{piece}"

    def segment(self, entry: str, node: str = "") -> str:
        return f"{self.prefix}segments/{entry}/{node}"

    def complete(self, entry: str, node: str = "") -> str:
        return f"{self.prefix}complete/{entry}/{node}"

    def device(self, entry: str, node: str = "", gpu: str = "") -> str:
        return f"{self.prefix}devices/{entry}/{node}/{gpu}" if node else f"{self.prefix}devices/{entry}/"

    def failed(self, entry: str) -> str:
        return f"{self.prefix}failed/{entry}"

    def family(self, kind: str) -> str:
        """The prefix of every key of ``kind`` (``"segments"``, ``"complete"``, ...)."""
        return f"{self.prefix}{kind}/"

    @staticmethod
    def names(under: str, key: str, count: int) -> tuple[str, ...]:
        """The ``count`` names that follow ``under`` in ``key`` (``under`` ends with ``/``).

        Raises:
            UnparsableRecord: ``key`` is not under ``under``, or what follows is not ``count`` names.
        """
        if not key.startswith(under):
            raise UnparsableRecord(f"not under {under}")
        names = tuple(key[len(under) :].split("/"))
        if len(names) != count or not all(NAME.fullmatch(name) for name in names):
            raise UnparsableRecord(f"not {count} name{'s' if count > 1 else ''} under {under}")
        return names

    @staticmethod
    def piece(under: str, key: str) -> int:
        """The piece number that follows ``under`` in ``key``.

        Raises:
            UnparsableRecord: it is not a piece number.
        """
        (name,) = FleetKeys.names(under, key, 1)
        if not name.isdigit() or len(name) > 9:
            raise UnparsableRecord("not a piece number")
        return int(name)
