"""A small real HTTP/1.1 server on 127.0.0.1 serving a directory with ranges and ETags, that can be told
to misbehave the ways hostile or broken servers do: ignore ``If-Match``, trickle its bodies, claim
another size in ``Content-Range`` or send a ``Content-Length`` that is not ASCII digits."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import os
import re
import sys
import threading
import time
import urllib.parse
from pathlib import Path

from typing_extensions import Self


@dataclasses.dataclass
class Misbehaviour:
    honour_if_match: bool = True
    trickle_seconds_per_byte: float = 0.0
    content_range_total: int | None = None
    """Claim this total in every Content-Range instead of the file's size."""
    content_length: str | None = None
    """Send this Content-Length in HEAD answers instead of the file's size."""
    virtual_size: int | None = None
    """Serve every file as this many bytes: its own, then zeros (a server claiming a huge file)."""
    redirect_to: str | None = None
    """Answer every request with ``302 Location: <redirect_to><path>`` (a Hub sending its clients to a CDN)."""
    forbid_next: int = 0
    """Answer this many of the next GETs ``403`` (an expired presigned URL)."""
    delay_s: float = 0.0
    """Wait this long before answering each range GET (a slow store: clients pile up behind one fill)."""
    forbid_from: int | None = None
    """Answer ``403`` to every range GET that starts at or past this byte (credentials revoked mid-read)."""
    rate_bytes_per_s: float = 0.0
    """Serve bodies at this many bytes per second in all, whatever the number of connections (a throttled bucket)."""


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 (keep-alive, as the client expects), nothing logged."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    """A client that goes away mid-answer (a killed node) is no error of the server's: nothing printed for it."""

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class LoopbackServer:
    """A threaded server of ``handler`` on ``host`` (port chosen by the kernel), ``url`` its address;
    ``with`` it to serve and to stop (every thread joined)."""

    def __init__(self, handler: type[http.server.BaseHTTPRequestHandler], host: str, name: str) -> None:
        self._server = _Server((host, 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class RangeServer(LoopbackServer):
    """``with RangeServer(root) as server: server.url``; ``server.misbehave`` may be changed at any time."""

    def __init__(self, root: Path, host: str = "127.0.0.1") -> None:
        self.root = root
        self.misbehave = Misbehaviour()
        self.requests: list[str] = []
        self.authorizations: list[str | None] = []
        """The ``Authorization`` header of every request, in order."""
        self.body_bytes = 0
        """Bytes of bodies sent so far."""
        self._pace = threading.Lock()
        self._next_send = 0.0
        self._etags: dict[tuple[int, ...], str] = {}
        outer = self

        class Handler(QuietHandler):
            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                outer.requests.append(f"{self.command} {self.path} {self.headers.get('Range')}")
                outer.authorizations.append(self.headers.get("Authorization"))
                if outer.misbehave.redirect_to is not None:
                    self.send_response(302)
                    self.send_header("Location", outer.misbehave.redirect_to + self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if body and outer.misbehave.forbid_next > 0:
                    outer.misbehave.forbid_next -= 1
                    self.send_response(403)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = re.match(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if body and start and outer.misbehave.delay_s:
                    time.sleep(outer.misbehave.delay_s)
                forbid_from = outer.misbehave.forbid_from
                if body and start and forbid_from is not None and int(start[1]) >= forbid_from:
                    self.send_response(403)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path = outer.root / urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
                if not path.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                etag, file_size = outer.etag(path)
                behaviour = outer.misbehave
                wanted = self.headers.get("If-Match")
                if wanted is not None and wanted != etag and behaviour.honour_if_match:
                    self.send_response(412)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                size = behaviour.virtual_size or file_size
                ranged = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range") or "")
                if ranged and body:
                    first, last = int(ranged[1]), min(int(ranged[2]), size - 1)
                    piece = read_range(path, first, last + 1 - first).ljust(last + 1 - first, b"\0")
                    self.send_response(206)
                    total = behaviour.content_range_total if behaviour.content_range_total is not None else size
                    self.send_header("Content-Range", f"bytes {first}-{last}/{total}")
                else:
                    piece = path.read_bytes() if body else b""
                    self.send_response(200)
                self.send_header("ETag", etag)
                length = (
                    str(len(piece))
                    if body
                    else (behaviour.content_length if behaviour.content_length is not None else str(size))
                )
                self.send_header("Content-Length", length)
                self.end_headers()
                if not body:
                    return
                if behaviour.trickle_seconds_per_byte:
                    for index in range(len(piece)):
                        self.wfile.write(piece[index : index + 1])
                        self.wfile.flush()
                        time.sleep(behaviour.trickle_seconds_per_byte)
                elif behaviour.rate_bytes_per_s:
                    for start in range(0, len(piece), 256 << 10):
                        chunk = piece[start : start + (256 << 10)]
                        outer.pace(len(chunk), behaviour.rate_bytes_per_s)
                        self.wfile.write(chunk)
                else:
                    self.wfile.write(piece)
                with outer._pace:
                    outer.body_bytes += len(piece)

        super().__init__(Handler, host, "test-range-server")

    def ranged_bytes(self) -> int:
        """Bytes the range GETs so far asked for (what a client read from this origin)."""
        ranges = [re.search(r"bytes=(\d+)-(\d+)", line) for line in self.requests if line.startswith("GET")]
        return sum(int(match[2]) - int(match[1]) + 1 for match in ranges if match)

    def etag(self, path: Path) -> tuple[str, int]:
        """``path``'s ETag (from its bytes, hashed once per version of the file: a replaced or rewritten file gets a
        new one) and its size."""
        status = path.stat()
        version = (status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)
        with self._pace:
            etag = self._etags.get(version)
        if etag is None:
            digest = hashlib.sha256()
            with open(path, "rb") as file:
                while chunk := file.read(8 << 20):
                    digest.update(chunk)
            etag = '"' + digest.hexdigest()[:16] + '"'
            with self._pace:
                self._etags[version] = etag
        return etag, status.st_size

    def pace(self, nbytes: int, rate: float) -> None:
        """Wait for ``nbytes`` of the server's shared sending budget at ``rate`` bytes per second."""
        with self._pace:
            now = time.monotonic()
            start = max(now, self._next_send)
            self._next_send = start + nbytes / rate
        time.sleep(max(0.0, start - now))


def read_range(path: Path, offset: int, nbytes: int) -> bytes:
    """At most ``nbytes`` of ``path`` from ``offset``."""
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(nbytes)


def replace_file(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (same name, new inode)."""
    temporary = path.with_name(path.name + ".new")
    temporary.write_bytes(data)
    os.replace(temporary, path)
