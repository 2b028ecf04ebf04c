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

PROTOCOLS = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}
"""URI scheme -> fsspec protocol."""

INSTALL_HINTS = {"s3": "pip install 'weightstream[s3]'", "gcs": "pip install 'weightstream[gcs]'"}


def filesystem(protocol: str, storage_options: Mapping[str, Any] | None) -> Any:
    """The fsspec filesystem for ``protocol`` (GCS version-aware, so reads can pin a generation)."""
    import fsspec

    # A filesystem of our own per store (not fsspec's shared instance), so that closing the store
    # closes its connections: nothing of a load outlives it.
    options = {**(storage_options or {}), "skip_instance_cache": True}
    if protocol == "gcs":
        # gcsfs 2025+ probes the bucket type over gRPC unless told not to; against emulators every call then hangs.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        options.setdefault("version_aware", True)
    try:
        return fsspec.filesystem(protocol, **options)
    except ImportError as error:
        raise UnsupportedInputError(f"{protocol}:// needs {error.name or 'its fsspec backend'}; {INSTALL_HINTS[protocol]}") from None


class ObjectStore:
    """Lists and opens objects under ``s3://`` or ``gs://``.

    Example:
        >>> store = ObjectStore("s3", {"endpoint_url": "http://127.0.0.1:8333"})  # doctest: +SKIP
        >>> store.open("s3://bench/model.safetensors").size  # doctest: +SKIP
        4096
    """

    def __init__(self, scheme: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.scheme = scheme
        self.protocol = PROTOCOLS[scheme]
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
        try:
            return function(*args, **kwargs)
        except FileNotFoundError:
            raise NotFound(f"{uri}: no such object") from None
        except PermissionError as error:
            raise SourceError(f"{uri}: access denied: {error}") from None
        except OSError as error:
            raise SourceError(f"{uri}: {error}") from None


class ObjectSource:
    """One object at one version; ranges are read with one request each."""

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
        """Fill ``buffer`` with bytes ``offset..offset+len(buffer)`` of this version of the object."""
        nbytes = len(buffer)
        if nbytes == 0:
            return
        if offset + nbytes > self.size:
            raise SourceError(f"{self.uri}: read of bytes {offset}..{offset + nbytes} past its end ({self.size} bytes)")
        data = self._fetch(offset, nbytes)
        if len(data) != nbytes:
            raise SourceError(
                f"{self.uri}: range {offset}..{offset + nbytes} answered with {len(data)} bytes "
                f"(a short body, or the whole object where a range was asked for)"
            )
        buffer[:] = data

    def _fetch(self, offset: int, nbytes: int) -> bytes:
        fs, key = self.store.fs, self.store._key(self.uri)
        span = f"{self.uri}: range {offset}..{offset + nbytes}"
        if self.store.protocol == "s3":
            return _s3_range(fs, key, offset, nbytes, self.version, span)
        try:
            return fs.cat_file(f"{key}#{self.version}", start=offset, end=offset + nbytes)
        except FileNotFoundError:
            raise SourceChangedError(f"{span}: generation {self.version} is gone (the object was replaced or deleted while loading)") from None
        except OSError as error:
            raise SourceError(f"{span}: {error}") from None

    def close(self) -> None:
        """Nothing to release: connections belong to the filesystem's pool."""


def _s3_range(fs: Any, key: str, offset: int, nbytes: int, etag: str, span: str) -> bytes:
    from fsspec.asyn import sync

    bucket, _, name = key.partition("/")

    async def get() -> tuple[dict, bytes]:
        answer = await fs._call_s3("get_object", Bucket=bucket, Key=name, Range=f"bytes={offset}-{offset + nbytes - 1}", IfMatch=etag)
        async with answer["Body"] as body:
            return answer, await body.read()

    try:
        answer, data = sync(fs.loop, get)
    except FileNotFoundError:
        raise SourceChangedError(f"{span}: the object was deleted while loading") from None
    except OSError as error:
        code = getattr(error.__cause__, "response", {}).get("Error", {}).get("Code")
        if code == "PreconditionFailed":
            raise SourceChangedError(f"{span}: ETag {etag} no longer matches (the object was replaced while loading)") from None
        raise SourceError(f"{span}: {error}") from None
    expected = f"bytes {offset}-{offset + nbytes - 1}/"
    if not str(answer.get("ContentRange", "")).startswith(expected):
        raise SourceError(f"{span}: answered {answer.get('ContentRange') or 'without a Content-Range (200, not 206)'}, expected {expected}...")
    return data


def _version(protocol: str, info: dict) -> str:
    key = "ETag" if protocol == "s3" else "generation"
    if not info.get(key):
        raise SourceError(f"{info.get('name')}: the store gave no {key}, so reads cannot be pinned to one version")
    return str(info[key])
