"""A fleet node serving one segment to its peers, as a process of its own: publishes the file ``PATH`` with a NIXL
agent named ``NODE``, writes what a peer needs (where the segment is, the metadata to reach it) as JSON to ``INFO``,
then serves until killed."""

from __future__ import annotations

import os
import sys
import time

from weightstream.nodecache.daemon.fleet.transfer import PieceServer


def main() -> None:
    path, node, info = sys.argv[1:4]
    server = PieceServer(node)
    fd = os.open(path, os.O_RDONLY)
    where = server.publish("segment", fd, os.fstat(fd).st_size)
    os.close(fd)
    with open(info + ".tmp", "wb") as file:
        file.write(where.encode())
    os.replace(info + ".tmp", info)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
