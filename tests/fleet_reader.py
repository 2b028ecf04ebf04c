"""A fleet peer's reader, as a process of its own: reads the whole segment that ``tests.fleet_holder`` NODE describes
in ``INFO`` with a NIXL agent of its own (one small read first, to connect), and prints the seconds the whole read
took as JSON (``{"seconds": S, "bytes": N}``): the capacity of the link between the two."""

from __future__ import annotations

import ctypes
import json
import mmap
import sys
import time

from weightstream.nodecache.daemon.fleet.records import parse_offer
from weightstream.nodecache.daemon.fleet.transfer import PieceFetcher


def main() -> None:
    node, info, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(info, "rb") as file:
        where = parse_offer(file.read())
    buffer = mmap.mmap(-1, size)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    fetcher = PieceFetcher("link-reader")
    fetcher.read(node, where, 0, 1 << 20, address)
    started = time.perf_counter()
    fetcher.read(node, where, 0, size, address)
    print(json.dumps({"seconds": time.perf_counter() - started, "bytes": size}), flush=True)


if __name__ == "__main__":
    main()
