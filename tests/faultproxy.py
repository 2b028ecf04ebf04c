"""A fault-injecting TCP proxy on loopback, between a client and a real object-store server.

It watches the client's request lines and, for the first ``times`` requests matching a pattern,
answers ``503 SlowDown`` itself, resets the connection after ``after_bytes`` of the answer, closes
it there (a short body), stops forwarding (a stall), or strips the ``Range`` header so that the
server answers ``200`` with the whole object. SigV4 signatures survive: requests pass through unchanged.
It records every request line with its Range header, so tests can see retries and resumptions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import socket
import struct
import threading

from typing_extensions import Self

SLOWDOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: 120\r\nConnection: close\r\n\r\n"
    + b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>".ljust(120)
)


@dataclasses.dataclass
class Fault:
    pattern: str
    mode: str  # "503", "reset", "short", "stall", "whole"
    times: int
    after_bytes: int = 0
    min_range_bytes: int = 0
    """Only requests whose Range spans at least this many bytes (so a cut after K bytes falls in the body)."""
    done: int = 0
    hits: list = dataclasses.field(default_factory=list)
    """The Range headers of the requests it hit."""


class FaultProxy:
    """``with FaultProxy(port) as proxy: proxy.url`` forwards to 127.0.0.1:port."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.requests: list[tuple[str, str | None]] = []
        self.heads: list[str] = []
        """Every request's line and headers, as sent."""
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="test-fault-proxy", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def inject(self, pattern: str, mode: str, times: int = 1, after_bytes: int = 0, min_range_bytes: int = 0) -> Fault:
        fault = Fault(pattern, mode, times, after_bytes, min_range_bytes)
        with self._lock:
            self._faults.append(fault)
        return fault

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stopping.wait()
        server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await server.wait_closed()

    async def _connection(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        armed = {"fault": None, "sent": 0}  # the fault of the request whose answer is flowing back
        try:
            await asyncio.gather(
                self._client_to_server(client_reader, upstream_writer, client_writer, armed),
                self._server_to_client(upstream_reader, client_writer, armed),
            )
        except (ConnectionError, asyncio.CancelledError, asyncio.IncompleteReadError):
            pass
        finally:
            for writer in (client_writer, upstream_writer):
                writer.close()
            self._tasks.discard(asyncio.current_task())

    async def _client_to_server(self, reader, upstream, client_writer, armed) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            text = head.decode("latin-1")
            line = text.split("\r\n", 1)[0]
            ranges = re.search(r"(?im)^range:\s*(.+)$", text)
            self.requests.append((line, ranges.group(1).strip() if ranges else None))
            self.heads.append(text)
            length = re.search(r"(?im)^content-length:\s*(\d+)$", text)
            fault = self._match(line, ranges.group(1).strip() if ranges else None)
            if fault is not None and fault.mode == "503":
                client_writer.write(SLOWDOWN)
                await client_writer.drain()
                raise ConnectionError("answered 503 SlowDown")
            if fault is not None and fault.mode == "whole":
                head = re.sub(rb"(?im)^range:[^\r\n]*\r\n", b"", head)
                fault = None
            armed["fault"], armed["sent"] = fault, 0
            upstream.write(head)  # the head first: a client sending "Expect: 100-continue" waits for the answer
            await upstream.drain()
            if length:
                upstream.write(await reader.readexactly(int(length.group(1))))
                await upstream.drain()

    async def _server_to_client(self, upstream, client_writer, armed) -> None:
        while True:
            data = await upstream.read(65536)
            if not data:
                return
            fault, sent = armed["fault"], armed["sent"]
            if fault is not None and sent + len(data) > fault.after_bytes:
                client_writer.write(data[: max(0, fault.after_bytes - sent)])
                await client_writer.drain()
                await asyncio.sleep(0.2)  # let the client take those bytes before the connection goes
                if fault.mode == "reset":
                    sock = client_writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    client_writer.transport.abort()
                    raise ConnectionError("reset")
                if fault.mode == "short":
                    raise ConnectionError(
                        "closed early"
                    )  # the connection closes cleanly: a body shorter than announced
                await asyncio.sleep(3600)  # stall: hold the connection, forward nothing more
            client_writer.write(data)
            armed["sent"] += len(data)
            await client_writer.drain()

    def _match(self, line: str, ranges: str | None) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if (
                    fault.done < fault.times
                    and re.search(fault.pattern, line)
                    and _span(ranges) >= fault.min_range_bytes
                ):
                    fault.done += 1
                    fault.hits.append(ranges)
                    return fault
        return None


def _span(ranges: str | None) -> int:
    """Bytes a ``Range: bytes=a-b`` header asks for (0 without one)."""
    match = re.fullmatch(r"bytes=(\d+)-(\d+)", ranges or "")
    return int(match.group(2)) - int(match.group(1)) + 1 if match else 0
