"""Objects in S3 and GCS: metadata through fsspec (s3fs, gcsfs), tensor bytes through our own
range client (:mod:`weightstream.sources.http_range`), straight into destination memory.

Every object is pinned to the version seen when it was opened: S3 ranges are fetched with
``If-Match: <ETag>``, GCS ranges from ``#<generation>``. An object replaced mid-load therefore
fails the read with :class:`SourceChangedError`, never a splice of two versions. Each range
answer is checked for its exact length and position (a short body, or a ``200`` carrying the
whole object where ``206`` was due, is an error, not data).

Endpoints and credentials come from the standard variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ..., ``STORAGE_EMULATOR_HOST``) or from ``storage_options``, passed to
the fsspec filesystem as they are.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from weightstream.errors import NotFound, SourceError, UnsupportedInputError
from weightstream.sources.http_range import RangeClient
from weightstream.sources.retry import RetryPolicy, Transient

PROTOCOLS = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}
"""URI scheme -> fsspec protocol."""

INSTALL_HINTS = {"s3": "pip install 'weightstream[s3]'", "gcs": "pip install 'weightstream[gcs]'"}

VERSION_KEYS = {"s3": "ETag", "gcs": "generation"}
"""The field of an object's metadata that names its version."""

PRESIGNED_LIFETIME_S = 3600
"""Presigned S3 URLs are valid this long, and made again after half of it."""


def filesystem(protocol: str, storage_options: Mapping[str, Any] | None) -> Any:
    """The fsspec filesystem for ``protocol`` (GCS version-aware, so reads can pin a generation)."""
    import fsspec

    # A filesystem of our own per store (not fsspec's shared instance), so that closing the store
    # closes its connections: nothing of a load outlives it.
    options = {**(storage_options or {}), "skip_instance_cache": True}
    if protocol == "s3":
        # Our retry loop (which resumes broken ranges) is the only one: botocore tries once (s3fs below).
        options.setdefault("config_kwargs", {"retries": {"max_attempts": 1, "mode": "standard"}})
    if protocol == "gcs":
        # gcsfs 2025+ probes the bucket type over gRPC unless told not to; against emulators every call then hangs.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        options.setdefault("version_aware", True)
    try:
        fs = fsspec.filesystem(protocol, **options)
    except ImportError as error:
        raise UnsupportedInputError(f"{protocol}:// needs {error.name or 'its fsspec backend'}; {INSTALL_HINTS[protocol]}") from None
    if protocol == "s3":
        fs.retries = 1  # s3fs's own attempts per call (a class attribute, not a constructor argument)
    return fs


class ObjectStore:
    """Lists and opens objects under ``s3://`` or ``gs://``.

    Example:
        >>> store = ObjectStore("s3", {"endpoint_url": "http://127.0.0.1:8333"})  # doctest: +SKIP
        >>> store.open("s3://bench/model.safetensors").size  # doctest: +SKIP
        4096
    """

    lists = True

    def __init__(self, scheme: str, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None) -> None:
        self.scheme = scheme
        self.protocol = PROTOCOLS[scheme]
        self.policy = policy or RetryPolicy()
        self.fs = filesystem(self.protocol, storage_options)
        self.ranges = RangeClient(self.policy)
        self._presigned: dict[str, tuple[str, float]] = {}
        self._presigning = threading.Lock()
        self._listed: dict[str, dict] = {}
        """URI -> its entry in a listing this store made (a load's snapshot; reads stay pinned to its versions)."""

    def is_dir(self, uri: str) -> bool:
        listed = self._listed.get(uri.rstrip("/"))
        if listed is not None:
            return listed.get("type") == "directory"
        return self._call(uri, self.fs.isdir, self._key(uri))

    def exists(self, uri: str) -> bool:
        return uri.rstrip("/") in self._listed or self._call(uri, self.fs.exists, self._key(uri))

    def list_names(self, uri: str) -> list[str]:
        """The entries of prefix ``uri``; what the listing says of each (type, size, version) answers
        later questions about them in this store without another request."""
        entries = self._call(uri, self.fs.ls, self._key(uri), detail=True, refresh=True)
        names = []
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            self._listed[self.join(uri, name)] = entry
            names.append(name)
        return sorted(names)

    def join(self, directory: str, name: str) -> str:
        return directory.rstrip("/") + "/" + name

    def open(self, uri: str, *, direct: bool | str = False) -> ObjectSource:
        """Open ``uri`` at its current version (``direct`` has no meaning for objects and is ignored)."""
        info = self._listed.get(uri.rstrip("/"))
        if info is None or not _has_version(self.protocol, info):
            info = self._call(uri, self.fs.info, self._key(uri), refresh=True)
        if info.get("type") == "directory":
            raise NotFound(f"{uri}: is a prefix, not an object")
        return ObjectSource(self, uri, int(info["size"]), _version(self.protocol, info))

    def open_pinned(self, uri: str, size: int, version: str) -> ObjectSource:
        return ObjectSource(self, uri, size, version)

    def range_target(self, source: ObjectSource) -> tuple[str, Mapping[str, str]]:
        """S3: a presigned URL with ``If-Match: <ETag>``; GCS: the download URL of the generation."""
        if self.protocol == "s3":
            return self._presigned_url(source.uri), {"If-Match": source.version}
        return self.fs.url(self._key(source.uri), generation=source.version), self.fs._get_headers({})

    def _presigned_url(self, uri: str) -> str:
        """A presigned GET URL for ``uri``, made again once half its lifetime has passed."""
        with self._presigning:
            url, made = self._presigned.get(uri, ("", -PRESIGNED_LIFETIME_S))
            if time.monotonic() - made > PRESIGNED_LIFETIME_S / 2:
                url = self._call(uri, self.fs.url, self._key(uri), expires=PRESIGNED_LIFETIME_S)
                self._presigned[uri] = (url, time.monotonic())
            return url

    def close(self) -> None:
        """Close this store's connections (range requests and the fsspec session); idempotent."""
        from fsspec.asyn import sync

        self.ranges.close()
        session = getattr(self.fs, "_s3", None) if self.protocol == "s3" else getattr(self.fs, "_session", None)
        if session is None:
            return
        if self.protocol == "s3":
            self.fs._s3 = None
            sync(self.fs.loop, session.__aexit__, None, None, None)
        elif not session.closed:
            sync(self.fs.loop, session.close)

    def _key(self, uri: str) -> str:
        return uri.split("://", 1)[1]

    def _call(self, uri: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        """A metadata call (info, ls, ...), retried like ranges; each attempt bounded by the stall timeout."""
        from fsspec.exceptions import FSTimeoutError

        def attempt() -> Any:
            try:
                return function(*args, timeout=self.policy.timeout(), **kwargs)  # fsspec's sync() takes `timeout`
            except FileNotFoundError:
                raise NotFound(f"{uri}: no such object") from None
            except PermissionError as error:
                raise SourceError(f"{uri}: access denied: {error}") from None
            except FSTimeoutError:
                raise Transient(f"no answer for {self.policy.timeout():.1f} s (stalled)", stalled=True) from None
            except Exception as error:  # noqa: BLE001 - 5xx, resets: s3fs and gcsfs raise many types
                raise Transient(f"{type(error).__name__}: {error}") from None

        return self.policy.run(uri, attempt)


class ObjectSource:
    """One object at one version; each range is one request, retried and resumed as the policy says."""

    direct = False

    def __init__(self, store: RangeStore, uri: str, size: int, version: str) -> None:
        self.store = store
        self.uri = uri
        self.size = size
        self.version = version

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
            url, headers = self.store.range_target(self)
            self.store.ranges.get_into(url, headers, offset, buffer, received, span)

        self.store.policy.run(span, attempt)

    def close(self) -> None:
        """Nothing to release: connections belong to the store."""


class RangeStore(Protocol):
    """What an :class:`ObjectSource` needs of its store: the retry policy, the connections, and
    the URL and headers that fetch ranges of one object at its pinned version."""

    policy: RetryPolicy
    ranges: RangeClient

    def range_target(self, source: ObjectSource) -> tuple[str, Mapping[str, str]]:
        """The URL and headers of a range request for ``source`` (without the ``Range`` header)."""


def _has_version(protocol: str, info: dict) -> bool:
    return bool(info.get(VERSION_KEYS[protocol]))


def _version(protocol: str, info: dict) -> str:
    key = VERSION_KEYS[protocol]
    if not info.get(key):
        raise SourceError(f"{info.get('name')}: the store gave no {key}, so reads cannot be pinned to one version")
    return str(info[key])
