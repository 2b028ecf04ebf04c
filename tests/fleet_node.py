"""A fleet node for the tests, as a process of its own: joins the fleet at ``ETCD PREFIX`` as ``NODE``, fills the
file at ``URL`` (an HTTP origin) into ``OUTPUT`` with the fleet's help, prints where its bytes came from as JSON, then
serves its copy to peers until its stdin closes, prints the bytes its peers read from it (JSON) and leaves.
``--piece-bytes N`` sets the piece size; ``--corrupt`` flips a byte of its copy after the fill (a peer serving bad
bytes); ``--ttl S`` the lease, ``--piece-timeout S`` each transfer's deadline, ``--entry-ttl S`` the lease of the
entry's plan and digests.

Device copies without a GPU: :class:`HostCopies` stands for the daemon's device tier, its copies in anonymous host
memory offered to peers as NIXL DRAM (the fleet's device path, everything but the GPU). ``--offer-device`` makes and
offers one after the fill (``--corrupt-device``: with a byte flipped); ``--device-fill`` fills through the device
path instead, and the JSON says how many copies it made and their sha256. A fill abandoned because a transfer may
still write its memory prints ``{"stuck": message, "kept": n}``; each line on stdin then asks the fetcher to release
what has ended since (``forget PEER`` first forgets that peer, as a failed fetch does), and it prints
``{"kept": n}``."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import json
import mmap
import os
import sys
from collections.abc import Callable

from weightstream.errors import MemoryStillInUseError
from weightstream.nodecache.daemon.fleet.devices import PeerDevices
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway
from weightstream.nodecache.daemon.fleet.fill import FleetFill
from weightstream.nodecache.daemon.fleet.membership import Membership
from weightstream.nodecache.daemon.fleet.record_store import RecordStore
from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher, PieceServer
from weightstream.sources import store_for

GPU = "GPU-host-stand-in"


class HostCopies:
    """The device tier's part in the fleet, with host memory for device memory."""

    memory = "DRAM"

    def __init__(self) -> None:
        self.copies: dict[tuple[str, str], mmap.mmap] = {}

    def index_of(self, uuid: str) -> int:
        return 0

    def make(self, key: str, uuid: str, nbytes: int, uri: str, write: Callable[[int], None]) -> bool:
        if (key, uuid) in self.copies:
            return False
        buffer = mmap.mmap(-1, nbytes)
        write(ctypes.addressof(ctypes.c_char.from_buffer(buffer)))
        self.copies[key, uuid] = buffer
        return True

    def to_host(self, address: int, host_address: int, nbytes: int) -> None:
        ctypes.memmove(host_address, address, nbytes)

    def drop(self, key: str) -> None:
        for wanted in [wanted for wanted in self.copies if wanted[0] == key]:
            del self.copies[wanted]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("etcd")
    parser.add_argument("prefix")
    parser.add_argument("node")
    parser.add_argument("url")
    parser.add_argument("output")
    parser.add_argument("--piece-bytes", type=int, default=16 << 20)
    parser.add_argument("--corrupt", action="store_true")
    parser.add_argument("--offer-device", action="store_true")
    parser.add_argument("--corrupt-device", action="store_true")
    parser.add_argument("--device-fill", action="store_true")
    parser.add_argument("--ttl", type=int, default=5)
    parser.add_argument("--piece-timeout", type=float, default=30.0)
    parser.add_argument("--entry-ttl", type=int, default=60)
    args = parser.parse_args()

    store = store_for(args.url)
    source = store.open(args.url)
    entry = hashlib.sha256(f"{args.url}\0{source.version}".encode()).hexdigest()[:32]

    def read_origin(offset: int, nbytes: int, address: int) -> None:
        source.read_into(offset, memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B"))

    server = PieceServer(args.node)
    fetcher = PieceFetcher(args.node, timeout_s=args.piece_timeout)
    member = Membership(RecordStore(EtcdGateway([args.etcd]), args.prefix), args.node, ttl_s=args.ttl)
    fd = os.open(args.output, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, source.size)
    fleet = FleetFill(member, fetcher, server, piece_bytes=args.piece_bytes, entry_ttl_s=args.entry_ttl)
    copies = HostCopies()
    devices = PeerDevices(fleet, copies)
    try:
        if args.device_fill:
            stats = devices.fill(
                entry, GPU, fd, source.size, args.url, lambda: fleet.fill(entry, fd, source.size, read_origin)
            )
        else:
            stats = fleet.fill(entry, fd, source.size, read_origin)
    except MemoryStillInUseError as error:  # the daemon fills a fresh file; here the test looks at what is kept
        print(json.dumps({"stuck": str(error), "kept": len(fetcher.stuck)}), flush=True)
        for line in sys.stdin:  # "reap": release what has ended since; "forget PEER": as a failed fetch does
            if line.startswith("forget "):
                fetcher.forget(line.split()[1])
            print(json.dumps({"kept": fetcher.reap()}), flush=True)
        fleet.close()
        member.close()
        server.close()
        return
    if args.corrupt:
        os.pwrite(fd, b"\xff" * 64, 4096)
    if args.offer_device:
        copies.make(
            entry, GPU, source.size, args.url, lambda address: os.preadv(fd, [copy_at(address, source.size)], 0)
        )
        copy = copies.copies[entry, GPU]
        if args.corrupt_device:
            copy[source.size - 1] ^= 0xFF
        devices.offer(entry, GPU, ctypes.addressof(ctypes.c_char.from_buffer(copy)), source.size)
    made = [hashlib.sha256(copy).hexdigest() for copy in copies.copies.values()]
    print(json.dumps({**dataclasses.asdict(stats), "device_copies": made}), flush=True)
    sys.stdin.read()
    print(json.dumps({"served": fleet.served_to_peers()}), flush=True)
    fleet.close()
    member.close()
    server.close()
    source.close()
    store.close()


def copy_at(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


if __name__ == "__main__":
    main()
