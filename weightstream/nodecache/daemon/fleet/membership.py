"""This node's place in the fleet: a key under the fleet's prefix, held by a lease the node keeps alive. A node
that dies (or loses etcd for longer than the lease) drops out by itself, and every claim it held with it.

Example:
    >>> member = Membership(etcd, "/weightstream", "node-a", {"address": "10.0.0.5"})  # doctest: +SKIP
    >>> sorted(member.peers())  # doctest: +SKIP
    ['node-a', 'node-b']
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

from weightstream.errors import FleetUnavailableError, logger
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway

log = logger(__name__)

LEASE_TTL_S = 10
"""How long a node that stopped renewing stays a member (and its claims stay claimed)."""


class Membership:
    """Node ``node`` of the fleet at ``prefix`` in ``etcd``, described by ``description`` (how peers reach it), for
    as long as the object lives: registered at once, renewed every third of the lease, revoked by :meth:`close`.

    Raises:
        FleetUnavailableError: etcd does not answer at start.
    """

    def __init__(
        self, etcd: EtcdGateway, prefix: str, node: str, description: dict[str, object], ttl_s: int = LEASE_TTL_S
    ) -> None:
        self.etcd, self.node, self.ttl_s = etcd, node, ttl_s
        self.nodes_prefix = f"{prefix.rstrip('/')}/nodes/"
        self._description = json.dumps({"node": node, **description}).encode()
        self._stop = threading.Event()
        self.on_registered_again: list[Callable[[int], None]] = []
        """Each called with the new lease after the node registered again (its keys under the old lease are gone)."""
        self.lease = self._register()
        self._renewer = threading.Thread(target=self._renew, name="weightstream-fleet-lease", daemon=True)
        self._renewer.start()

    def peers(self) -> dict[str, dict[str, object]]:
        """The live nodes (this one included) and their descriptions."""
        return {
            key.removeprefix(self.nodes_prefix): json.loads(value)
            for key, value in self.etcd.get_prefix(self.nodes_prefix).items()
        }

    def close(self) -> None:
        """Leave the fleet: stop renewing and revoke the lease (this node's claims go with it)."""
        self._stop.set()
        self._renewer.join()
        try:
            self.etcd.revoke(self.lease)
        except FleetUnavailableError as error:
            log.warning("leaving the fleet: %s (the lease expires by itself in %d s)", error, self.ttl_s)

    def _register(self) -> int:
        lease = self.etcd.grant(self.ttl_s)
        self.etcd.put(self.nodes_prefix + self.node, self._description, lease)
        return lease

    def _renew(self) -> None:
        unreachable = False
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self.etcd.keepalive(self.lease) == 0:
                    log.warning("fleet lease of %s expired (etcd was out of reach): registering again", self.node)
                    self.lease = self._register()
                    for offer_again in self.on_registered_again:
                        offer_again(self.lease)
                if unreachable:
                    log.warning("fleet: etcd answers again")
                unreachable = False
            except FleetUnavailableError as error:
                if not unreachable:
                    log.warning("fleet: cannot renew %s's lease: %s", self.node, error)
                unreachable = True
