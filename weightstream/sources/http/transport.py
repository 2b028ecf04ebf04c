"""Range GETs over keep-alive HTTP/1.1 connections, read straight into destination memory.

The transport under every object store: S3 (a presigned URL per object), GCS (the object's
download URL at one generation) and plain ``http(s)://``. Each reader thread keeps one
connection per origin; the body of an answer is read with ``readinto`` into the caller's
buffer, so no intermediate ``bytes`` object is made and the socket reads release the GIL.
Measured against aiobotocore through fsspec (one event-loop thread copying every chunk) it
is what lets a load approach the server's rate; see ``benchmarks/README.md``.

A request either fills its whole buffer or raises: :class:`Transient` for what deserves
another attempt (5xx, 429, a reset or stalled connection, a short body), with
``received[0]`` telling how far the bytes got, so the caller resumes from there; a typed
:class:`SourceError` for what does not (access denied, a missing or changed object, an
answer that is not the range asked for).
"""

from __future__ import annotations

import dataclasses
import http.client
import re
import socket
import ssl
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Mapping
from typing import TypeVar

from weightstream.errors import AccessDeniedError, SourceChangedError, SourceError, SourceTimeout, WeightstreamError
from weightstream.sources.retry import RetryPolicy, Transient

ERROR_BODY_BYTES = 2048
"""How much of an error answer's body is kept for the message."""
Answer = TypeVar("Answer")

PIECE_BYTES = 256 << 10
"""A body is read at most this much at a time: a broken answer loses at most the piece being read
(a buffered read that fails keeps no count of what it got), and resumes after the last whole piece."""
MIN_RATE_BYTES_PER_S = 64 << 10
"""A request whose body arrives slower than this over a whole stall timeout counts as stalled (and is
retried): a server trickling a byte a second never trips a per-byte timeout."""
CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,20})-([0-9]{1,20})/([0-9]{1,20}|\*)")


@dataclasses.dataclass(frozen=True)
class RangeTarget:
    """Where the ranges of one pinned object come from, and how an answer proves it is of that version."""

    url: str
    headers: Mapping[str, str]
    version_header: str | None = None
    """The answer header naming the version it holds (``ETag``, ``x-goog-generation``, ``Last-Modified``)."""
    version: str | None = None
    """What that header must say; an answer saying otherwise is of a replaced object."""


class _ThreadConnections:
    """One reader thread's connections, by origin (scheme, host, port)."""

    def __init__(self) -> None:
        self.by_origin: dict[tuple[str, str | None, int | None], http.client.HTTPConnection] = {}


class RangeClient:
    """HTTP connections for one load: one per reader thread and origin, all closed by :meth:`close`.

    Example:
        >>> client = RangeClient(RetryPolicy())
        >>> client.close()
    """

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()
        self._closed = False
        self._tls: ssl.SSLContext | None = None

    def get_into(
        self, target: RangeTarget, size: int, start: int, buffer: memoryview, received: list[int], span: str
    ) -> None:
        """GET bytes ``start + received[0]`` .. ``start + len(buffer)`` of ``target`` (an object of ``size``
        bytes) into ``buffer[received[0]:]``.

        ``received[0]`` advances as bytes land. Raises :class:`Transient` for a failure worth another
        attempt (the connection is dropped), :class:`SourceChangedError` for an answer of another version
        or size, :class:`SourceTimeout` when the load's deadline passes, :class:`SourceError` otherwise.
        """
        first, last = start + received[0], start + len(buffer) - 1

        def land(response: http.client.HTTPResponse, connection: http.client.HTTPConnection) -> None:
            if response.status != 206:
                raise _refusal(response, span, first, last)
            _check_range(response, span, first, last, size)
            _check_version(response, span, target)
            self._read_body(response, connection, buffer, received, span)

        self._exchange(
            "GET",
            target.url,
            {**target.headers, "Range": f"bytes={first}-{last}"},
            land,
            lambda: f"after {received[0]} of {len(buffer)} bytes",
        )

    def head(self, url: str, headers: Mapping[str, str]) -> http.client.HTTPResponse:
        """A HEAD request's answer (status and headers; no body), for ``http(s)://`` metadata."""

        def finish(
            response: http.client.HTTPResponse, connection: http.client.HTTPConnection
        ) -> http.client.HTTPResponse:
            response.read()
            return response

        return self._exchange("HEAD", url, headers, finish, lambda: "before the answer")

    def fetch(self, url: str, headers: Mapping[str, str], limit: int) -> tuple[http.client.HTTPResponse, bytes]:
        """A GET of a whole small document (an API's JSON answer): the answer and its body, :class:`SourceError`
        if the body is over ``limit`` bytes (read no further than that)."""

        def finish(
            response: http.client.HTTPResponse, connection: http.client.HTTPConnection
        ) -> tuple[http.client.HTTPResponse, bytes]:
            body = response.read(limit + 1)
            if len(body) > limit:
                raise SourceError(f"{url}: the answer is over {limit} bytes, more than a document of this kind holds")
            return response, body

        return self._exchange("GET", url, headers, finish, lambda: "while reading the answer")

    def _exchange(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        handle: Callable[[http.client.HTTPResponse, http.client.HTTPConnection], Answer],
        where: Callable[[], str],
    ) -> Answer:
        """Send one request on this thread's connection to the URL's origin and ``handle`` its answer.

        A stall or a broken connection becomes :class:`Transient` (``where()`` says how far it got);
        on any failure the connection is dropped, since the rest of its answer is unread.
        """
        parts = urllib.parse.urlsplit(url)
        connection = self._connection(parts)
        try:
            connection.timeout = self.policy.timeout()
            if connection.sock is not None:
                connection.sock.settimeout(connection.timeout)
            connection.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), headers=dict(headers))
            return handle(connection.getresponse(), connection)
        except (WeightstreamError, Transient):
            self._drop(connection)
            raise
        except TimeoutError:
            self._drop(connection)
            raise Transient(f"no byte for {connection.timeout:.1f} s {where()} (stalled)", stalled=True) from None
        except ssl.SSLCertVerificationError as error:
            self._drop(connection)
            raise SourceError(
                f"{parts.scheme}://{parts.netloc}: TLS certificate verification failed: {error.verify_message}"
            ) from None
        except socket.gaierror as error:
            self._drop(connection)
            if error.errno == socket.EAI_AGAIN:
                raise Transient(f"name lookup of {parts.hostname} failed for now {where()}: {error.strerror}") from None
            raise SourceError(f"{parts.hostname}: no such host ({error.strerror})") from None
        except (OSError, http.client.IncompleteRead, http.client.RemoteDisconnected) as error:
            self._drop(connection)
            raise Transient(f"connection broke {where()}: {type(error).__name__}: {error}") from None
        except http.client.HTTPException as error:
            self._drop(connection)
            raise SourceError(
                f"{parts.scheme}://{parts.netloc}: the answer is not valid HTTP {where()}: {type(error).__name__}: "
                f"{error}"
            ) from None
        except BaseException:
            self._drop(connection)
            raise

    def close(self) -> None:
        """Close every connection of this client; idempotent. Requests after it raise."""
        with self._lock:
            self._closed = True
            connections, self._open = self._open, set()
        for connection in connections:
            connection.close()

    def _connection(self, parts: urllib.parse.SplitResult) -> http.client.HTTPConnection:
        origin = (parts.scheme, parts.hostname, parts.port)
        holder = getattr(self._local, "holder", None)
        if holder is None:
            holder = self._local.holder = _ThreadConnections()
            # A thread that ends (a fill's pool, done) leaves its connections to no one: closed as it goes, or a
            # client that outlives its threads (a daemon's store) would keep one socket per thread that ever read.
            weakref.finalize(holder, self._close_thread, holder.by_origin)
        connections = holder.by_origin
        connection = connections.get(origin)
        if connection is not None and connection in self._open:
            return connection
        if parts.scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            connection = http.client.HTTPSConnection(
                parts.hostname, parts.port, timeout=self.policy.timeout(), context=self._tls
            )
        elif parts.scheme == "http":
            connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.policy.timeout())
        else:
            raise SourceError(f"{parts.geturl()}: unsupported URL scheme {parts.scheme!r} for a range read")
        with self._lock:
            if self._closed:
                raise SourceError(f"{parts.geturl()}: the load's connections are closed")
            self._open.add(connection)
        connections[origin] = connection
        return connection

    def _close_thread(self, connections: dict[tuple[str, str | None, int | None], http.client.HTTPConnection]) -> None:
        """Close the connections of a thread that ended."""
        with self._lock:
            for connection in connections.values():
                self._open.discard(connection)
        for connection in connections.values():
            connection.close()

    def _drop(self, connection: http.client.HTTPConnection) -> None:
        """Close a connection whose state is unknown (a broken or unread answer); the next request opens another."""
        with self._lock:
            self._open.discard(connection)
        connection.close()

    def _read_body(
        self,
        response: http.client.HTTPResponse,
        connection: http.client.HTTPConnection,
        buffer: memoryview,
        received: list[int],
        span: str,
    ) -> None:
        """Read the body into ``buffer[received[0]:]``, each socket read straight into it; the load's deadline
        is enforced between reads (and bounds each one), and so is the minimum rate (:data:`MIN_RATE_BYTES_PER_S`)."""
        window_start, window_bytes = time.monotonic(), 0
        while received[0] < len(buffer):
            if self.policy.deadline is not None:
                if time.monotonic() >= self.policy.deadline:
                    raise SourceTimeout(
                        f"{span}: the load's deadline passed after {received[0]} of {len(buffer)} bytes"
                    )
                connection.sock.settimeout(self.policy.timeout())
            count = _read_some(response, buffer[received[0] : received[0] + PIECE_BYTES])
            if not count:
                raise Transient(f"short body: the answer ended after {received[0]} of {len(buffer)} bytes")
            received[0] += count
            window_bytes += count
            elapsed = time.monotonic() - window_start
            if elapsed >= self.policy.request_timeout_s:
                if window_bytes < MIN_RATE_BYTES_PER_S * elapsed:
                    raise Transient(
                        f"{window_bytes} bytes in {elapsed:.1f} s, below {MIN_RATE_BYTES_PER_S} bytes/s (stalled)",
                        stalled=True,
                    )
                window_start, window_bytes = time.monotonic(), 0
        if response.read(1):
            raise SourceError(f"{span}: the answer carried more bytes than its range")


def _read_some(response: http.client.HTTPResponse, view: memoryview) -> int:
    """Up to ``len(view)`` body bytes into ``view``, from at most one socket read (so a trickling server
    cannot hold one call for long). ``HTTPResponse.readinto`` fills the whole view first; its own
    bookkeeping (the bytes left, the connection released at the end) is kept here as it keeps it."""
    if response.chunked or response.length is None or response.fp is None:
        return response.readinto(view)
    view = view[: response.length]
    count = response.fp.readinto1(view)
    if not count and view:
        response._close_conn()  # what readinto does at a premature end
    else:
        response.length -= count
        if not response.length:
            response._close_conn()
    return count


def _check_range(response: http.client.HTTPResponse, span: str, first: int, last: int, size: int) -> None:
    """The answer holds exactly bytes ``first..last`` of an object of ``size`` bytes (a total of ``*``: unknown,
    accepted)."""
    content_range = response.getheader("Content-Range", "")
    match = CONTENT_RANGE.fullmatch(content_range.strip())
    if match is None or (int(match[1]), int(match[2])) != (first, last):
        raise SourceError(
            f"{span}: answered 206 with Content-Range {content_range or '(none)'}, expected bytes {first}-{last}/{size}"
        )
    if match[3] != "*" and int(match[3]) != size:
        raise SourceChangedError(
            f"{span}: the answer says the object has {match[3]} bytes, {size} when it was opened (replaced while "
            "loading)"
        )


def _check_version(response: http.client.HTTPResponse, span: str, target: RangeTarget) -> None:
    """An answer that names its version must name the pinned one (a server may ignore ``If-Match``)."""
    if target.version_header is None:
        return
    said = response.getheader(target.version_header)
    if said is not None and said != target.version:
        raise SourceChangedError(
            f"{span}: the answer is of version {said} ({target.version_header}), {target.version} when it was opened "
            "(replaced while loading)"
        )


def _refusal(response: http.client.HTTPResponse, span: str, first: int, last: int) -> Exception:
    """The error for a non-206 answer, its body read (so the message can quote the store's code)."""
    status = response.status
    body = response.read(ERROR_BODY_BYTES).decode("utf-8", "replace") if status != 200 else ""
    code = _error_code(body)
    said = f"HTTP {status}{f' {code}' if code else ''}"
    if status == 200:
        return SourceError(
            f"{span}: answered 200 with the whole object, not 206 with bytes {first}-{last} (the server ignored the "
            "range)"
        )
    if status == 412:
        return SourceChangedError(
            f"{span}: {said}: the object no longer matches the version planned (replaced while loading)"
        )
    if status == 404:
        return SourceChangedError(
            f"{span}: {said}: the object at the version planned is gone (deleted or replaced while loading)"
        )
    if status in (401, 403):
        denied = AccessDeniedError(f"{span}: access denied ({said})")
        denied.status, denied.challenge = status, response.getheader("WWW-Authenticate") or ""
        return denied
    if status in (408, 429) or status >= 500:
        return Transient(said)
    return SourceError(f"{span}: {said}: {body[:300]}")


def _error_code(body: str) -> str:
    """The ``<Code>`` of an S3 error document, if the body is one."""
    start = body.find("<Code>")
    end = body.find("</Code>", start)
    return body[start + len("<Code>") : end] if start >= 0 and end > start else ""
