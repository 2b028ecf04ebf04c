"""A range client that outlives its reader threads (a node cache daemon's store: every fill runs on threads of its
own) closes each thread's connections as the thread ends, instead of keeping one socket per thread that ever read
(found by the fleet soak: 64 connections to the origin after 150 fills)."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from tests.rangeserver import RangeServer
from weightstream.sources.http.transport import RangeClient, RangeTarget
from weightstream.sources.retry import RetryPolicy


def connections_to(port: int) -> int:
    """This process's established TCP connections to ``port`` on loopback."""
    inodes = set()
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == port and fields[3] == "01":
            inodes.add(fields[9])
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd is gone by now
            mine.add(os.readlink(f"/proc/self/fd/{fd}"))
    return sum(f"socket:[{inode}]" in mine for inode in inodes)


def test_a_threads_connections_close_when_it_ends(tmp_path: Path):
    data = os.urandom(1 << 20)
    (tmp_path / "blob").write_bytes(data)
    with RangeServer(tmp_path) as server:
        port = int(server.url.rsplit(":", 1)[1])
        client = RangeClient(RetryPolicy())
        target = RangeTarget(f"{server.url}/blob", {})
        got = []

        def read() -> None:
            buffer = bytearray(4096)
            client.get_into(target, len(data), 4096, memoryview(buffer), [0], "blob")
            got.append(bytes(buffer))

        try:
            for _ in range(12):
                thread = threading.Thread(target=read)
                thread.start()
                thread.join()
            assert got == [data[4096:8192]] * 12
            assert connections_to(port) == 0, "ended threads left their connections open"
            read()  # the caller's own thread: its connection stays for its next request
            assert connections_to(port) == 1
        finally:
            client.close()
        assert connections_to(port) == 0
