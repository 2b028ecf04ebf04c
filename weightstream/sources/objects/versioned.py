"""What S3, GCS and HTTP(S) share: one object at one version, read by range requests, and the store
behind it (its retry policy and connections).

Each range is one request through the store's range client, retried and resumed as the store's policy
says; each answer is checked for its exact length and position (a short body, or a ``200`` carrying the
whole object where ``206`` was due, is an error, not data).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from weightstream.errors import InvalidOptionError, SourceError
from weightstream.sources.http.transport import RangeClient, RangeTarget
from weightstream.sources.retry import RetryPolicy


class RangeSource:
    """One object at one version; each range is one request, retried and resumed as the policy says."""

    direct = False

    def __init__(self, store: RangeStore, uri: str, size: int, version: str, whole_sha256: str | None = None) -> None:
        self.store = store
        self.uri = uri
        self.size = size
        self.version = version
        self.whole_sha256 = whole_sha256
        """The sha256 the origin states for the whole object (S3's full-object ``ChecksumSHA256``), if any."""

    def read(self, offset: int, nbytes: int) -> bytes:
        buffer = bytearray(nbytes)
        self.read_into(offset, memoryview(buffer))
        return bytes(buffer)

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with bytes ``offset..offset+len(buffer)`` of this version of the object.

        Transient failures are retried with backoff; a broken range resumes from the byte reached.
        """
        nbytes = len(buffer)
        span = f"{self.uri}: range {offset}..{offset + nbytes}"
        if offset + nbytes > self.size:
            raise SourceError(f"{span} is past its end ({self.size} bytes)")
        if nbytes == 0:
            return
        received = [0]  # kept across attempts: each asks only for the bytes still missing

        def attempt() -> None:
            self.store.ranges.get_into(self.store.range_target(self), self.size, offset, buffer, received, span)

        self.store.policy.run(span, attempt)

    def verify_unchanged(self) -> None:
        """Nothing to check after the reads: every answer was checked against the pinned version as it came."""

    def close(self) -> None:
        """Nothing to release: connections belong to the store."""


class RangeStore(Protocol):
    """What an :class:`RangeSource` needs of its store: the retry policy, the connections, and
    the URL and headers that fetch ranges of one object at its pinned version."""

    policy: RetryPolicy
    ranges: RangeClient

    def range_target(self, source: RangeSource) -> RangeTarget:
        """The URL and headers of a range request for ``source`` (without the ``Range`` header), and the
        answer header that must name its pinned version."""


class RemoteStore:
    """The part of every remote store that is the same: a retry policy and the load's range connections,
    objects reopened at a pinned version without a request, no page cache, ``/``-joined names, and
    metadata calls retried as the store's ``_classify`` says (stores that make them define it)."""

    lists = True

    def __init__(self, policy: RetryPolicy | None) -> None:
        self.policy = policy or RetryPolicy()
        self.ranges = RangeClient(self.policy)

    def join(self, directory: str, name: str) -> str:
        return directory.rstrip("/") + "/" + name

    def resolve_direct(self, uri: str, direct: bool | str) -> bool:
        """Objects are never read around a page cache."""
        return False

    def open_pinned(self, uri: str, size: int, version: str, *, direct: bool | str = False) -> RangeSource:
        return RangeSource(self, uri, size, version)

    def close(self) -> None:
        """Close the range connections; idempotent (stores with more to close extend it)."""
        self.ranges.close()

    def _call(self, uri: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A metadata call, retried like ranges: only what ``_classify`` makes :class:`Transient` is tried
        again; anything else it returns is raised (a programming error as it is, once)."""

        def attempt() -> Any:
            try:
                return function(*args, **self._attempt_options(), **kwargs)
            except Exception as error:  # noqa: BLE001 - classified: what is neither the store's nor the network's is raised as it is
                raise self._classify(uri, error) from None

        return self.policy.run(uri, attempt)

    def _attempt_options(self) -> dict[str, Any]:
        """Keyword arguments each attempt of a metadata call adds (none here)."""
        return {}


def known_options(scheme: str, storage_options: Mapping[str, Any] | None, allowed: tuple[str, ...]) -> dict[str, Any]:
    """``storage_options`` as a dict, once every name in it is one ``scheme``'s store takes.

    Raises:
        InvalidOptionError: a name it does not take.

    Example:
        >>> known_options("oci", {"endpoint_url": "x"}, ("username", "password"))
        Traceback (most recent call last):
        ...
        weightstream.errors.InvalidOptionError: storage_options for oci:// take username, password; got endpoint_url
    """
    options = dict(storage_options or {})
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise InvalidOptionError(f"storage_options for {scheme}:// take {', '.join(allowed)}; got {', '.join(unknown)}")
    return options
