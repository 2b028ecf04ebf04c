"""One fleet node for the tests, as a process of its own: joins the fleet at ``ENDPOINT PREFIX`` as ``NODE``, claims
pieces ``0..PIECES-1`` of ``ENTRY`` and prints the ones it won as JSON; with ``--hold``, it then keeps its lease alive
until killed."""

from __future__ import annotations

import json
import sys
import time

from weightstream.nodecache.daemon.fleet.claims import Claims
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway
from weightstream.nodecache.daemon.fleet.membership import Membership
from weightstream.nodecache.daemon.fleet.record_store import RecordStore


def main() -> None:
    endpoint, prefix, node, entry, pieces = sys.argv[1:6]
    etcd = EtcdGateway([endpoint])
    member = Membership(RecordStore(etcd, prefix), node, ttl_s=3)
    claims = Claims(member.store, node, lambda: member.lease)
    won = [piece for piece in range(int(pieces)) if claims.claim(entry, piece)[0]]
    print(json.dumps(won), flush=True)
    if "--hold" in sys.argv:
        while True:
            time.sleep(1)
    member.close()


if __name__ == "__main__":
    main()
