"""The cache daemon as a member of a fleet (``cache serve --fleet etcd://HOST:PORT/PREFIX``): its fills of remote
files go through :class:`~weightstream.nodecache.daemon.fleet.fill.FleetFill`, its evictions withdraw what it
offered, and ``stats`` counts where the bytes came from. Local files are never shared: a path names a file on this
node only.

Example:
    >>> fleet = FleetNode.join(["etcd://10.0.0.2:2379/weightstream"], "node-a")  # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import mmap
import os
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Sequence

from weightstream.errors import CacheConfigError, FleetUnavailableError, IntegrityError, MemoryStillInUseError, logger
from weightstream.nodecache.daemon.fleet.devices import DeviceCopies, PeerDevices
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway
from weightstream.nodecache.daemon.fleet.fill import FleetFill, ReadOrigin
from weightstream.nodecache.daemon.fleet.membership import Membership
from weightstream.nodecache.daemon.fleet.origin_digest import check_held
from weightstream.nodecache.daemon.fleet.pieces import FillStats
from weightstream.nodecache.daemon.fleet.record_store import RecordStore
from weightstream.nodecache.daemon.fleet.records import NAME
from weightstream.nodecache.daemon.fleet.transfer import PIECE_TIMEOUT_S, PieceFetcher, PieceServer, memory_at, nixl
from weightstream.nodecache.daemon.segments import FILL_CHUNK_BYTES, Segment, read_piece
from weightstream.sources import REMOTE_SCHEMES
from weightstream.sources.base import Source
from weightstream.sources.local.raw_mapping import map_file, unmap

log = logger(__name__)


@dataclasses.dataclass(frozen=True)
class FleetAddress:
    """Where a fleet coordinates: etcd's endpoints and the key prefix its nodes share."""

    endpoints: tuple[str, ...]
    prefix: str


def parse_fleet(urls: Sequence[str]) -> FleetAddress:
    """``--fleet`` URLs (``etcd://HOST:PORT[/PREFIX]``, ``etcds://`` for TLS; repeatable: one per etcd member, one
    prefix for all) as endpoints and a prefix (default ``/weightstream``).

    Raises:
        CacheConfigError: a URL of another scheme, without a host, or prefixes that differ.

    Example:
        >>> parse_fleet(["etcd://10.0.0.2:2379/models", "etcd://10.0.0.3:2379/models"])
        FleetAddress(endpoints=('http://10.0.0.2:2379', 'http://10.0.0.3:2379'), prefix='/models')
    """
    endpoints, prefixes = [], set()
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("etcd", "etcds") or not parts.hostname:
            raise CacheConfigError(f"--fleet {url!r}: not etcd://HOST:PORT[/PREFIX] (or etcds:// with TLS)")
        scheme = "https" if parts.scheme == "etcds" else "http"
        endpoints.append(f"{scheme}://{parts.hostname}:{parts.port or 2379}")
        prefixes.add("/" + parts.path.strip("/") if parts.path.strip("/") else "/weightstream")
    if len(prefixes) != 1:
        raise CacheConfigError(f"--fleet: one prefix for every endpoint, got {sorted(prefixes)}")
    return FleetAddress(tuple(endpoints), prefixes.pop())


def tls_context(
    ca: str | None, certificate: str | None, key: str | None, address: FleetAddress | None = None
) -> ssl.SSLContext | None:
    """The TLS context for ``etcds://`` endpoints (a CA to trust, a client certificate), or None for the default.

    Raises:
        CacheConfigError: files that cannot apply (TLS options for a cleartext ``etcd://`` endpoint of ``address``, a
            key without a certificate, a certificate without a key), or that do not load.

    Example:
        >>> tls_context("ca.pem", None, None, parse_fleet(["etcd://10.0.0.2:2379/models"]))
        Traceback (most recent call last):
        ...
        weightstream.errors.CacheConfigError: --fleet-ca, --fleet-cert and --fleet-key apply to etcds:// (TLS) only; ...
    """
    given = ca is not None or certificate is not None or key is not None
    cleartext = [endpoint for endpoint in (address.endpoints if address else ()) if endpoint.startswith("http://")]
    if given and cleartext:
        raise CacheConfigError(
            "--fleet-ca, --fleet-cert and --fleet-key apply to etcds:// (TLS) only; "
            f"{cleartext[0].replace('http://', 'etcd://', 1)} is cleartext"
        )
    if (certificate is None) != (key is None):
        raise CacheConfigError(
            "--fleet-key without --fleet-cert" if certificate is None else "--fleet-cert without --fleet-key"
        )
    if ca is None and certificate is None:
        return None
    try:
        context = ssl.create_default_context(cafile=ca)
        if certificate is not None:
            context.load_cert_chain(certificate, key)
    except (OSError, ssl.SSLError) as error:
        raise CacheConfigError(f"--fleet TLS files: {error}") from None
    return context


def check_node_name(node: str) -> None:
    """Refuse a node name that would break the fleet's key paths.

    Raises:
        CacheConfigError: it has characters other than letters, digits, ``.``, ``_`` and ``-`` (or starts with one of
            the last three), or is longer than 253.

    Example:
        >>> check_node_name("node-a.rack2")
        >>> check_node_name("a/b")
        Traceback (most recent call last):
        ...
        weightstream.errors.CacheConfigError: --fleet-node 'a/b': a name of letters, digits, '.', '_' and '-' (as a ...
    """
    if not NAME.fullmatch(node):
        raise CacheConfigError(
            f"--fleet-node {node[:80]!r}: a name of letters, digits, '.', '_' and '-' (as a host name), at most 253"
        )


def describe_fleet(address: FleetAddress, tls: ssl.SSLContext | None = None) -> dict[str, object]:
    """What ``cache fleet`` shows: each live node, the entries each holds whole or is filling, and its device copies
    (``ENTRY GPU``).

    Raises:
        FleetUnavailableError: etcd does not answer.
    """
    with EtcdGateway(address.endpoints, tls) as etcd:
        return _described(etcd, address)


def _described(etcd: EtcdGateway, address: FleetAddress) -> dict[str, object]:
    store = RecordStore(etcd, address.prefix)
    nodes: dict[str, dict[str, list[str]]] = {
        node: {"complete": [], "filling": [], "devices": []} for node in store.nodes()
    }
    segments, complete, devices = store.offered()
    for entry, node in sorted(segments):
        if node in nodes:
            nodes[node]["complete" if (entry, node) in complete else "filling"].append(entry)
    for entry, node, gpu in sorted(devices):
        if node in nodes:
            nodes[node]["devices"].append(f"{entry} {gpu}")
    return {"prefix": address.prefix, "endpoints": list(address.endpoints), "nodes": nodes}


class FleetNode:
    """This daemon in the fleet: membership, the pieces it offers and fetches, and its fills' counts."""

    def __init__(self, fill: FleetFill, membership: Membership, server: PieceServer) -> None:
        self._fill, self.membership, self.server = fill, membership, server
        self.counters = {**dataclasses.asdict(FillStats()), "fills_without_fleet": 0, "transfers_stuck": 0}
        self.entries: dict[str, dict[str, int]] = {}
        """Where each entry filled since the daemon started got its bytes (as ``counters``, for that entry)."""
        self.devices: PeerDevices | None = None
        """This node's device copies in the fleet (where the daemon keeps some: :meth:`use_devices`)."""
        self._lock = threading.Lock()

    @classmethod
    def join(
        cls,
        address: FleetAddress,
        node: str,
        tls: ssl.SSLContext | None = None,
        home: str = "",
        home_is_free: Callable[[], bool] = lambda: False,
        transfer_timeout_s: float = PIECE_TIMEOUT_S,
    ) -> FleetNode:
        """Join the fleet at ``address`` as ``node`` (from ``home``: see :class:`Membership`), each piece's transfer
        from a peer given ``transfer_timeout_s``.

        Raises:
            CacheConfigError: NIXL is not installed (with the hint), or a live node of the fleet has the name.
            FleetUnavailableError: etcd does not answer.
        """
        check_node_name(node)
        nixl()
        etcd = EtcdGateway(address.endpoints, tls)
        membership = Membership(RecordStore(etcd, address.prefix), node, home=home, home_is_free=home_is_free)
        server = PieceServer(node)
        return cls(FleetFill(membership, PieceFetcher(node, transfer_timeout_s), server), membership, server)

    def use_devices(self, copies: DeviceCopies) -> PeerDevices:
        """Offer the device copies of ``copies`` (the daemon's device tier) to peers, and fill device requests from
        peers' copies; what the tier tells of the copies it makes and releases."""
        self.devices = PeerDevices(self._fill, copies)
        return self.devices

    def fill(
        self,
        key: str,
        source: Source,
        fd: int,
        threads: int,
        cancel: threading.Event | None,
        gpu: str | None = None,
    ) -> bool:
        """Fill the file ``fd`` with ``source``'s bytes with the fleet's help (sizing it first), for a client that
        wants its copy on GPU ``gpu`` where one is named (read from a peer's device copy where one serves it, this
        node's device copy made on the way), then checked whole against the origin's digest where it has one (see
        :meth:`_check_whole`); False for a local file (this node's alone), out of the fleet, or where etcd went away
        (logged and counted): the caller then reads the whole file from the origin as it would alone.

        Raises:
            SourceChangedError, SourceError: as the origin's reads raise them.
            IntegrityError: the origin's own bytes do not match its digest.
            MemoryStillInUseError: a peer's transfer into ``fd``'s memory could not be stopped (the caller fills a
                fresh file).
        """

        def read_origin(offset: int, nbytes: int, into: int) -> None:
            view = memory_at(into, nbytes)
            with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="weightstream-fleet-origin") as pool:
                reads = [
                    pool.submit(read_piece, source, offset + at, view[at : at + FILL_CHUNK_BYTES], cancel)
                    for at in range(0, nbytes, FILL_CHUNK_BYTES)
                ]
                for read in reads:
                    read.result()

        def from_hosts() -> FillStats:
            return self._fill.fill(key, fd, source.size, read_origin)

        if not source.uri.startswith(REMOTE_SCHEMES):
            return False  # a local file is this node's alone
        if self.membership.refused is not None:
            log.warning("%s: this node is out of the fleet (%s): filling from the origin alone",
                        source.uri, self.membership.refused)  # fmt: skip
            self._count("fills_without_fleet", 1)
            return False
        os.ftruncate(fd, source.size)
        try:
            if gpu is None or self.devices is None:
                stats = from_hosts()
            else:
                stats = self.devices.fill(key, gpu, fd, source.size, source.uri, from_hosts)
        except FleetUnavailableError as error:
            log.warning("%s: the fleet's etcd went away (%s): filling from the origin alone", source.uri, error)
            self._count("fills_without_fleet", 1)
            return False
        except MemoryStillInUseError:
            self._count("transfers_stuck", 1)
            raise
        self._add(key, dataclasses.asdict(stats))
        self._check_whole(key, source, fd, read_origin)
        return True

    def _check_whole(self, key: str, source: Source, fd: int, read_origin: ReadOrigin) -> None:
        """Check the bytes the fleet filled into ``fd`` against what the origin says of the whole file (an OCI
        blob's digest, an S3 checksum). Where they are not the origin's, a peer served bytes matching digests a
        member of the fleet published: the node stops offering them (its device copies made from peers go too),
        reads the whole file from the origin, checks it again, corrects the fleet's piece digests that differ from
        its bytes (now the origin's) and offers it again (logged and counted).

        Raises:
            IntegrityError: the origin's own bytes do not match what it says of them.
        """
        try:
            check_held(source, fd)
            return
        except IntegrityError as error:
            log.warning("%s: filled by the fleet, read from the origin again", error)
        self.evicted(key)
        self._add(key, {"entries_refetched": 1, "bytes_refetched": source.size})
        address = map_file(fd, source.size, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            read_origin(0, source.size, address)
            check_held(source, fd)
            try:
                self._add(key, {"digests_corrected": self._fill.offer(key, fd, source.size, check=True)})
            except FleetUnavailableError as error:
                log.warning("fleet: %s read again from the origin, not offered (%s)", source.uri, error)
        finally:
            unmap(address, source.size)

    def _add(self, key: str, counts: dict[str, int]) -> None:
        """Add ``counts`` to this node's totals and to entry ``key``'s."""
        with self._lock:
            entry = self.entries.setdefault(key, dataclasses.asdict(FillStats()))
            for name, value in counts.items():
                self.counters[name] += value
                entry[name] += value

    def offer(self, segments: Iterable[Segment], path_of: Callable[[str], str]) -> int:
        """Offer the fleet the remote files this node already holds (its segments adopted at start); how many."""
        offered = 0
        for segment in segments:
            if not segment.size or not segment.uri.startswith(REMOTE_SCHEMES):
                continue  # a local file is this node's alone
            fd = os.open(path_of(segment.key), os.O_RDONLY | os.O_CLOEXEC)
            try:
                self._fill.offer(segment.key, fd, segment.size)
            finally:
                os.close(fd)
            offered += 1
        return offered

    def evicted(self, key: str) -> None:
        """Stop offering segment ``key`` (evicted, or its fill failed: its device copies go too)."""
        if self.devices is not None:
            self.devices.copies.drop(key)
        try:
            self._fill.forget(key)
        except FleetUnavailableError as error:
            log.warning("fleet: %s evicted, but etcd was not told (%s): its keys go with this node's lease", key, error)

    def status(self) -> dict[str, object]:
        """This node's counts in all and per entry, with the bytes its peers read from it (as their agents told this
        node's), why etcd was last out of reach (``etcd_error``: None while its lease renews), and the transfers kept
        out of use now (``transfers_kept_out_of_use``: 0 once each has ended).

        Example:
            >>> node.status()["bytes_served_to_peers"]  # doctest: +SKIP
            268435456
        """
        served = self._fill.served_to_peers()
        with self._lock:
            entries = {key: dict(counts) for key, counts in self.entries.items()}
            counters = dict(self.counters)
        for key, nbytes in served.items():
            entries.setdefault(key, dataclasses.asdict(FillStats()))["bytes_served_to_peers"] = nbytes
        for counts in entries.values():
            counts.setdefault("bytes_served_to_peers", 0)
        return {"node": self.membership.node, "out_of_fleet": self.membership.refused, **counters,
                "bytes_served_to_peers": sum(served.values()), "etcd_error": self.membership.etcd_error,
                "bad_records": self.membership.store.bad_records, "bad_notices": self.server.bad_notices,
                "transfers_kept_out_of_use": len(self._fill.fetcher.stuck), "entries": entries}  # fmt: skip

    def close(self) -> None:
        """Leave the fleet (the lease revoked: every claim and offer of this node goes with it)."""
        self._fill.close()
        self.membership.close()
        self.server.close()
        self.membership.etcd.close()

    def _count(self, name: str, value: int) -> None:
        with self._lock:
            self.counters[name] += value
