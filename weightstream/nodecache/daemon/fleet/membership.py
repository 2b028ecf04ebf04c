"""This node's place in the fleet: a key under the fleet's prefix (``nodes/{node}``), held by a lease the node keeps
alive. A node that dies (or loses etcd for longer than the lease) drops out by itself, and every claim it held with
it. A name is one node's: a second daemon asking for a name a live node holds is refused, naming that node's lease.

Example:
    >>> member = Membership(store, "node-a")  # doctest: +SKIP
    >>> sorted(member.peers())  # doctest: +SKIP
    ['node-a', 'node-b']
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from weightstream.errors import CacheConfigError, FleetUnavailableError, logger
from weightstream.nodecache.daemon.fleet.etcd import Held, LeaseNotFound
from weightstream.nodecache.daemon.fleet.record_store import RecordStore
from weightstream.nodecache.daemon.fleet.records import NodeRecord, parse_node

log = logger(__name__)

LEASE_TTL_S = 10
"""How long a node that stopped renewing stays a member (and its claims stay claimed)."""


class Membership:
    """Node ``node`` of the fleet of ``store``, for as long as the object lives: registered at once, renewed every
    third of the lease, revoked by :meth:`close`.

    Raises:
        CacheConfigError: a live node holds the name ``node`` already (the message names its lease).
        FleetUnavailableError: etcd does not answer at start.
    """

    def __init__(
        self,
        store: RecordStore,
        node: str,
        ttl_s: int = LEASE_TTL_S,
        home: str = "",
        home_is_free: Callable[[], bool] = lambda: False,
    ) -> None:
        self.store, self.etcd, self.node, self.ttl_s = store, store.etcd, node, ttl_s
        self.home, self.home_is_free = home, home_is_free
        """This daemon's home (:class:`NodeRecord`) and whether no daemon runs there now: a live key of this name
        with this home is then a dead predecessor's (killed, its lease not yet expired) and is taken over."""
        self._stop = threading.Event()
        self.on_registered_again: list[Callable[[int], None]] = []
        """Each called with the new lease after the node registered again (its keys under the old lease are gone);
        one that fails (etcd went away again) is called again at each renewal until it succeeds."""
        self._pending: list[Callable[[int], None]] = []
        self.renewals: list[Callable[[], object]] = []
        """Each called at every renewal of the lease (other leases this node keeps alive with it)."""
        self.etcd_error: str | None = None
        """Why the last renewal failed (etcd out of reach), None once one succeeds."""
        self.refused: str | None = None
        """Why this node is out of the fleet for good (another daemon took its name while its lease had expired);
        None while it is a member."""
        self.lease = self._register()
        self._renewer = threading.Thread(target=self._renew, name="weightstream-fleet-lease", daemon=True)
        self._renewer.start()

    def peers(self) -> dict[str, NodeRecord]:
        """The live nodes (this one included), by name."""
        return self.store.nodes()

    def close(self) -> None:
        """Leave the fleet: stop renewing and revoke the lease (this node's claims go with it)."""
        self._stop.set()
        self._renewer.join()
        if self.refused is not None:
            return  # its lease expired, and the name is another's
        try:
            self.etcd.revoke(self.lease)
        except FleetUnavailableError as error:
            log.warning("leaving the fleet: %s (the lease expires by itself in %d s)", error, self.ttl_s)

    def _register(self) -> int:
        lease = self.etcd.grant(self.ttl_s)
        key = self.store.keys.node(self.node)
        held = self.etcd.create(key, NodeRecord(self.node, self.home).encode(), lease)
        if held is not None and self._predecessor(key, held):
            log.warning("fleet: %s's previous daemon on this directory died (its lease %x): taking its place",
                        self.node, held.lease)  # fmt: skip
            with contextlib.suppress(LeaseNotFound):
                self.etcd.revoke(held.lease)  # its claims and offers go with it, as at its expiry
            held = self.etcd.create(key, NodeRecord(self.node, self.home).encode(), lease)
        if held is not None:
            self.etcd.revoke(lease)
            raise CacheConfigError(
                f"--fleet-node {self.node}: a live node of the fleet has this name (its lease {held.lease:x}): give "
                "each daemon a name of its own (two daemons on one host share its host name, the default)"
            )
        return lease

    def _predecessor(self, key: str, held: Held) -> bool:
        """Whether the live node key ``held`` is this daemon's dead predecessor's: its home is this one's, and no
        daemon runs there now."""
        record = self.store.parsed(key, held.value, parse_node)
        return bool(self.home) and record is not None and record.home == self.home and self.home_is_free()

    def _renew(self) -> None:
        unreachable = False
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.etcd.keepalive(self.lease) == 0:
                    log.warning("fleet lease of %s expired (etcd was out of reach): registering again", self.node)
                    self.lease = self._register()
                    self._pending = list(self.on_registered_again)
                self._call_pending()
                for renewal in self.renewals:
                    renewal()
                if unreachable:
                    log.warning("fleet: etcd answers again")
                unreachable, self.etcd_error = False, None
            except FleetUnavailableError as error:
                if not unreachable:
                    log.warning("fleet: cannot renew %s's lease: %s", self.node, error)
                unreachable, self.etcd_error = True, str(error)
            except CacheConfigError as error:  # another daemon took the name while this one was out of reach
                self.refused = str(error)
                log.error("fleet: %s; this node stays out of the fleet until it is restarted", error)
                return

    def _call_pending(self) -> None:
        """Call each callback still owed the current lease; one that fails stays owed (and the error goes on)."""
        while self._pending:
            self._pending[0](self.lease)
            self._pending.pop(0)
