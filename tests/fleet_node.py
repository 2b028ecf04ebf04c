"""A fleet node for the tests, as a process of its own: joins the fleet at ``ETCD PREFIX`` as ``NODE``, fills the
file at ``URL`` (an HTTP origin) into ``OUTPUT`` with the fleet's help, prints where its bytes came from as JSON, then
serves its copy to peers until its stdin closes. ``--piece-bytes N`` sets the piece size; ``--corrupt`` flips a byte
of its copy after the fill (a peer serving bad bytes)."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import json
import os
import sys

from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway
from weightstream.nodecache.daemon.fleet.fill import FleetFill
from weightstream.nodecache.daemon.fleet.membership import Membership
from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher, PieceServer
from weightstream.sources import store_for


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("etcd")
    parser.add_argument("prefix")
    parser.add_argument("node")
    parser.add_argument("url")
    parser.add_argument("output")
    parser.add_argument("--piece-bytes", type=int, default=16 << 20)
    parser.add_argument("--corrupt", action="store_true")
    args = parser.parse_args()

    store = store_for(args.url)
    source = store.open(args.url)
    entry = hashlib.sha256(f"{args.url}\0{source.version}".encode()).hexdigest()[:32]

    def read_origin(offset: int, nbytes: int, address: int) -> None:
        source.read_into(offset, memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B"))

    server = PieceServer(args.node)
    fetcher = PieceFetcher(args.node)
    member = Membership(EtcdGateway([args.etcd]), args.prefix, args.node, {}, ttl_s=5)
    fd = os.open(args.output, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, source.size)
    stats = FleetFill(member, fetcher, server, piece_bytes=args.piece_bytes).fill(entry, fd, source.size, read_origin)
    if args.corrupt:
        os.pwrite(fd, b"\xff" * 64, 4096)
    print(json.dumps(dataclasses.asdict(stats)), flush=True)
    sys.stdin.read()
    member.close()
    server.close()
    source.close()
    store.close()


if __name__ == "__main__":
    main()
