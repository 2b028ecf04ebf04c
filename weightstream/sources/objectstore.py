"""Objects in S3 and GCS, through fsspec (s3fs, gcsfs).

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
from collections.abc import Mapping
from typing import Any

from weightstream.errors import NotFound, SourceChangedError, SourceError, UnsupportedInputError
from weightstream.sources.retry import RetryPolicy, Transient

PROTOCOLS = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}
"""URI scheme -> fsspec protocol."""

INSTALL_HINTS = {"s3": "pip install 'weightstream[s3]'", "gcs": "pip install 'weightstream[gcs]'"}


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

    def __init__(self, scheme: str, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None) -> None:
        self.scheme = scheme
        self.protocol = PROTOCOLS[scheme]
        self.policy = policy or RetryPolicy()
        self.fs = filesystem(self.protocol, storage_options)

    def is_dir(self, uri: str) -> bool:
        return self._call(uri, self.fs.isdir, self._key(uri))

    def exists(self, uri: str) -> bool:
        return self._call(uri, self.fs.exists, self._key(uri))

    def list_names(self, uri: str) -> list[str]:
        entries = self._call(uri, self.fs.ls, self._key(uri), detail=False, refresh=True)
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries)

    def join(self, directory: str, name: str) -> str:
        return directory.rstrip("/") + "/" + name

    def open(self, uri: str, *, direct: bool | str = False) -> ObjectSource:
        """Open ``uri`` at its current version (``direct`` has no meaning for objects and is ignored)."""
        info = self._call(uri, self.fs.info, self._key(uri), refresh=True)
        if info.get("type") == "directory":
            raise NotFound(f"{uri}: is a prefix, not an object")
        return ObjectSource(self, uri, int(info["size"]), _version(self.protocol, info))

    def close(self) -> None:
        """Close this store's HTTP sessions (their pooled connections); idempotent."""
        from fsspec.asyn import sync

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

        attempt = 1
        while True:
            self.policy.check_deadline(uri)
            try:
                return function(*args, timeout=self.policy.timeout(), **kwargs)  # fsspec's sync() takes `timeout`
            except FileNotFoundError:
                raise NotFound(f"{uri}: no such object") from None
            except PermissionError as error:
                raise SourceError(f"{uri}: access denied: {error}") from None
            except FSTimeoutError:
                failure = Transient(f"no answer for {self.policy.timeout():.1f} s (stalled)", stalled=True)
            except Exception as error:  # noqa: BLE001 - 5xx, resets: s3fs and gcsfs raise many types
                failure = Transient(f"{type(error).__name__}: {error}")
            attempt += 1
            self.policy.wait_before(attempt, uri, failure)


class ObjectSource:
    """One object at one version; each range is one request, retried and resumed as the policy says."""

    direct = False

    def __init__(self, store: ObjectStore, uri: str, size: int, version: str) -> None:
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
        from fsspec.asyn import sync

        nbytes = len(buffer)
        span = f"{self.uri}: range {offset}..{offset + nbytes}"
        if offset + nbytes > self.size:
            raise SourceError(f"{span} is past its end ({self.size} bytes)")
        policy, received, attempt = self.store.policy, [0], 1
        while received[0] < nbytes:
            policy.check_deadline(span)
            try:
                sync(self.store.fs.loop, self._stream, offset, buffer, received, span)
            except Transient as failure:
                attempt += 1
                policy.wait_before(attempt, span, failure)

    async def _stream(self, offset: int, buffer: memoryview, received: list[int], span: str) -> None:
        """One request for the bytes not yet received; ``received[0]`` advances as chunks land."""
        start = offset + received[0]
        end = offset + len(buffer)  # exclusive
        if self.store.protocol == "s3":
            await _s3_stream(self.store, self.uri, start, end, self.version, buffer, received, span)
        else:
            await _gcs_stream(self.store, self.uri, start, end, self.version, buffer, received, span)

    def close(self) -> None:
        """Nothing to release: connections belong to the store's session."""


CHUNK = 1 << 20


async def _drain(read: Any, buffer: memoryview, received: list[int], wanted: int, policy: RetryPolicy, span: str) -> None:
    """Copy chunks from ``read(n)`` into ``buffer`` until ``wanted`` bytes have arrived in all."""
    import asyncio

    while received[0] < wanted:
        try:
            chunk = await asyncio.wait_for(read(min(CHUNK, wanted - received[0])), policy.timeout())
        except asyncio.TimeoutError:
            raise Transient(f"no byte for {policy.timeout():.1f} s after {received[0]} of {wanted} bytes (stalled)", stalled=True) from None
        except Exception as error:  # noqa: BLE001 - resets and protocol errors surface as many types (aiohttp, botocore)
            raise Transient(f"connection broke after {received[0]} of {wanted} bytes: {type(error).__name__}: {error}") from None
        if not chunk:
            raise Transient(f"short body: the answer ended after {received[0]} of {wanted} bytes")
        buffer[received[0] : received[0] + len(chunk)] = chunk
        received[0] += len(chunk)


async def _s3_stream(store: ObjectStore, uri: str, start: int, end: int, etag: str, buffer: memoryview, received: list[int], span: str) -> None:
    import asyncio

    bucket, _, name = store._key(uri).partition("/")
    try:
        answer = await asyncio.wait_for(
            store.fs._call_s3("get_object", Bucket=bucket, Key=name, Range=f"bytes={start}-{end - 1}", IfMatch=etag),
            store.policy.timeout(),
        )
    except asyncio.TimeoutError:
        raise Transient(f"no answer for {store.policy.timeout():.1f} s (stalled)", stalled=True) from None
    except FileNotFoundError:
        raise SourceChangedError(f"{span}: the object was deleted while loading") from None
    except PermissionError as error:
        raise SourceError(f"{span}: access denied: {error}") from None
    except OSError as error:
        code = getattr(error.__cause__, "response", {}).get("Error", {}).get("Code")
        if code == "PreconditionFailed":
            raise SourceChangedError(f"{span}: ETag {etag} no longer matches (the object was replaced while loading)") from None
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket"):
            raise SourceError(f"{span}: {code}: {error}") from None
        raise Transient(f"{code or type(error).__name__}: {error}") from None
    except Exception as error:  # noqa: BLE001 - botocore/aiohttp connection and protocol errors: worth a retry
        raise Transient(f"{type(error).__name__}: {error}") from None
    expected = f"bytes {start}-{end - 1}/"
    async with answer["Body"] as body:
        if not str(answer.get("ContentRange", "")).startswith(expected):
            raise SourceError(f"{span}: answered {answer.get('ContentRange') or 'without a Content-Range (200, not 206)'}, expected {expected}...")
        await _drain(body.read, buffer, received, len(buffer), store.policy, span)


async def _gcs_stream(store: ObjectStore, uri: str, start: int, end: int, generation: str, buffer: memoryview, received: list[int], span: str) -> None:
    import asyncio

    import aiohttp

    fs = store.fs
    url = fs.url(store._key(uri), generation=generation)
    headers = fs._get_headers({"Range": f"bytes={start}-{end - 1}"})
    session = await fs._set_session()
    try:
        response = await asyncio.wait_for(session.get(url, headers=headers), store.policy.timeout())
    except asyncio.TimeoutError:
        raise Transient(f"no answer for {store.policy.timeout():.1f} s (stalled)", stalled=True) from None
    except (aiohttp.ClientError, OSError) as error:
        raise Transient(f"{type(error).__name__}: {error}") from None
    async with response:
        if response.status == 404:
            raise SourceChangedError(f"{span}: generation {generation} is gone (the object was replaced or deleted while loading)")
        if response.status in (401, 403):
            raise SourceError(f"{span}: access denied ({response.status})")
        if response.status == 429 or response.status >= 500:
            raise Transient(f"HTTP {response.status}")
        expected = f"bytes {start}-{end - 1}/"
        if response.status != 206 or not response.headers.get("Content-Range", "").startswith(expected):
            raise SourceError(
                f"{span}: answered HTTP {response.status} {response.headers.get('Content-Range') or 'without a Content-Range'}, "
                f"expected 206 {expected}..."
            )
        await _drain(response.content.read, buffer, received, len(buffer), store.policy, span)


def _version(protocol: str, info: dict) -> str:
    key = "ETag" if protocol == "s3" else "generation"
    if not info.get(key):
        raise SourceError(f"{info.get('name')}: the store gave no {key}, so reads cannot be pinned to one version")
    return str(info[key])
