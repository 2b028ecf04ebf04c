"""Checkpoints served over plain ``http://`` and ``https://``.

Metadata comes from ``HEAD`` answers, bytes from range GETs through the same client as the
object stores. Every file is pinned to the version its ``HEAD`` showed: a strong ``ETag``
(sent back as ``If-Match``) or, without one, ``Last-Modified`` (``If-Unmodified-Since``); a
server that gives neither cannot be read consistently and is refused. HTTP has no directory
listing, so a directory URL must hold ``model.safetensors.index.json``.
"""

from __future__ import annotations

import dataclasses
import http.client
import re
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from weightstream.errors import InvalidOptionError, NotFound, SourceError, UnsupportedInputError
from weightstream.sources.http.transport import RangeTarget
from weightstream.sources.objects.versioned import RangeSource, RemoteStore
from weightstream.sources.retry import RetryPolicy, Transient

FILE_SUFFIXES = (".safetensors", ".json", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""A URL whose last segment ends so names a file; any other URL names a directory."""
MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
Exchange = tuple[http.client.HTTPResponse, bytes]
"""An answer and the body read from it (empty for a HEAD)."""
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})
"""Headers never sent to a host other than the one the caller named."""
DEFAULT_PORTS = {"http": 80, "https": 443}
CONTENT_LENGTH = re.compile(r"[0-9]{1,20}")
"""ASCII digits only (``str.isdigit`` takes superscripts, which ``int`` refuses), and a size that fits 64 bits."""
LAST_MODIFIED = "last-modified "
"""Prefix of a version that is a ``Last-Modified`` date rather than an ETag."""


@dataclasses.dataclass
class RedirectTrail:
    """Where one request's redirects have led so far, kept across its retries: a retry is sent where the
    last attempt had got to, and :data:`MAX_REDIRECTS` bounds every hop of every attempt."""

    location: str
    hops: int = 0


class HttpStore(RemoteStore):
    """Opens files under ``http(s)://`` URLs; ``storage_options`` may hold ``headers`` (e.g. ``Authorization``).
    It cannot list directories (``lists`` is False): a directory is known by the files it is asked for.

    Example:
        >>> store = HttpStore({"headers": {"Authorization": "Bearer ..."}})
        >>> store.is_dir("https://example.com/llama/"), store.is_dir("https://example.com/llama/model.safetensors")
        (True, False)
        >>> store.close()
    """

    lists = False

    def __init__(self, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None) -> None:
        options = dict(storage_options or {})
        unknown = sorted(set(options) - {"headers"})
        if unknown:
            raise InvalidOptionError(f"storage_options for http(s):// take only 'headers', got {', '.join(unknown)}")
        self.headers: dict[str, str] = dict(options.get("headers") or {})
        super().__init__(policy)
        self._locations: dict[str, str] = {}
        """URI -> where its redirects led (ranges go there)."""

    def is_dir(self, uri: str) -> bool:
        """By the URL's path (a query string, ``?download=true`` or a signature, is not part of the name)."""
        path = urllib.parse.urlsplit(uri).path
        return not path.rstrip("/").endswith(FILE_SUFFIXES) or path.endswith("/")

    def exists(self, uri: str) -> bool:
        """Files: whether ``HEAD`` finds them. Directories always "exist": what they hold is found by name."""
        return self.is_dir(uri) or self._head(uri, missing_ok=True) is not None

    def list_names(self, uri: str) -> list[str]:
        raise UnsupportedInputError(f"{uri}: HTTP has no directory listing")

    def join(self, directory: str, name: str) -> str:
        """``name`` inside ``directory``; the directory's query string, if any, goes with every file in it.

        Example:
            >>> HttpStore().join("https://hub.example/llama/?download=true", "model.safetensors")
            'https://hub.example/llama/model.safetensors?download=true'
        """
        parts = urllib.parse.urlsplit(directory)
        return urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/" + urllib.parse.quote(name)))

    def open(self, uri: str, *, direct: bool | str = False) -> RangeSource:
        """Open ``uri`` at the version its ``HEAD`` shows (``direct`` has no meaning here and is ignored)."""
        answer = self._head(uri)
        length = answer.getheader("Content-Length")
        if length is None or not CONTENT_LENGTH.fullmatch(length.strip()):
            raise SourceError(
                f"{uri}: the server gave no Content-Length of decimal digits ({length!r}), so the file's size is "
                "unknown"
            )
        etag = answer.getheader("ETag")
        modified = answer.getheader("Last-Modified")
        if etag and not etag.startswith("W/"):
            version = etag
        elif modified:
            version = LAST_MODIFIED + modified
        else:
            raise SourceError(
                f"{uri}: the server gave neither a strong ETag nor Last-Modified, so reads cannot be pinned to one "
                "version"
            )
        return RangeSource(self, uri, int(length), version)

    def range_target(self, source: RangeSource) -> RangeTarget:
        """Where redirects led, the precondition of the pinned version, and the header its answers must repeat
        (servers that ignore ``If-Match`` still say which ETag they answer from)."""
        location = self._locations.get(source.uri, source.uri)
        if source.version.startswith(LAST_MODIFIED):
            modified = source.version[len(LAST_MODIFIED) :]
            return RangeTarget(
                location,
                {**self.headers_for(source.uri, location), "If-Unmodified-Since": modified},
                "Last-Modified",
                modified,
            )
        return RangeTarget(
            location, {**self.headers_for(source.uri, location), "If-Match": source.version}, "ETag", source.version
        )

    def storage_options(self) -> dict[str, object]:
        """The options that make a store of this one's reads (its headers, credentials included) in another process:
        what the node cache daemon reads this store's files with, a Hub token among them (sent to the Hub only).

        Example:
            >>> store = HttpStore({"headers": {"Authorization": "Bearer t"}})
            >>> store.storage_options()
            {'headers': {'Authorization': 'Bearer t'}}
            >>> store.close()
        """
        return {"headers": dict(self.headers)}

    def headers_for(self, uri: str, location: str) -> dict[str, str]:
        """The caller's headers for a request to ``location`` on behalf of ``uri``: without credentials
        (``Authorization``, ``Proxy-Authorization``, ``Cookie``) once a redirect has left ``uri``'s host,
        as ``requests`` does (a Hub token must not reach the CDN it redirects to).

        Example:
            >>> store = HttpStore({"headers": {"Authorization": "Bearer t", "User-Agent": "x"}})
            >>> store.headers_for("https://hub.example/m.safetensors", "https://cdn.example/blob")
            {'User-Agent': 'x'}
            >>> store.close()
        """
        if _same_authority(uri, location):
            return dict(self.headers)
        return {name: value for name, value in self.headers.items() if name.lower() not in CREDENTIAL_HEADERS}

    def redirected(self, uri: str, send: Callable[[str, dict[str, str]], Exchange], trail: RedirectTrail) -> Exchange:
        """``send(location, headers)`` from where ``trail`` has got to for ``uri``, then wherever its redirects
        lead (at most :data:`MAX_REDIRECTS` in all), credentials only where :meth:`headers_for` allows: the
        last answer (with its body, if ``send`` read one); ``trail.location`` is where it came from."""
        while True:
            exchange = send(trail.location, self.headers_for(uri, trail.location))
            answer = exchange[0]
            if answer.status not in REDIRECT_STATUSES or not answer.getheader("Location"):
                return exchange
            trail.hops += 1
            if trail.hops > MAX_REDIRECTS:
                raise SourceError(f"{uri}: more than {MAX_REDIRECTS} redirects")
            trail.location = urllib.parse.urljoin(trail.location, answer.getheader("Location"))

    def _head(self, uri: str, missing_ok: bool = False) -> http.client.HTTPResponse | None:
        """The ``HEAD`` answer for ``uri`` after redirects (retried like ranges), or None if missing and
        ``missing_ok``."""
        trail = RedirectTrail(uri)

        def attempt() -> http.client.HTTPResponse | None:
            answer, _ = self.redirected(
                uri, lambda location, headers: (self.ranges.head(location, headers), b""), trail
            )
            if answer.status == 200:
                self._locations[uri] = trail.location
                return answer
            if answer.status == 404 and missing_ok:
                return None
            if answer.status == 404:
                raise NotFound(f"{uri}: HTTP 404, no such file")
            if answer.status in (401, 403):
                raise SourceError(f"{uri}: access denied (HTTP {answer.status})")
            if answer.status in (408, 429) or answer.status >= 500:
                raise Transient(f"HTTP {answer.status}")
            raise SourceError(f"{uri}: HEAD answered HTTP {answer.status} {answer.reason}")

        return self.policy.run(uri, attempt)


def _same_authority(uri: str, location: str) -> bool:
    """Whether ``location`` may receive ``uri``'s credentials: the same host and port, or the same host
    upgraded from ``http`` to ``https`` on the default ports (``requests``' rule)."""
    before, after = urllib.parse.urlsplit(uri), urllib.parse.urlsplit(location)
    if (before.hostname or "").lower() != (after.hostname or "").lower():
        return False
    port_before = before.port or DEFAULT_PORTS.get(before.scheme)
    port_after = after.port or DEFAULT_PORTS.get(after.scheme)
    if (before.scheme, port_before) == (after.scheme, port_after):
        return True
    return (before.scheme, port_before, after.scheme, port_after) == ("http", 80, "https", 443)
