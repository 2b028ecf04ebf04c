"""Objects in Google Cloud Storage: metadata through fsspec's gcsfs, tensor bytes through our own range
client (:mod:`weightstream.sources.http.transport`), straight into destination memory.

Every object is pinned to the generation seen when it was opened: ranges are fetched from the
download URL of that generation, so an object replaced mid-load fails its read (404 for the old
generation) with :class:`SourceChangedError`, never a splice. Endpoint and credentials come from the
standard variables (``STORAGE_EMULATOR_HOST``, ``GOOGLE_APPLICATION_CREDENTIALS``, ...) or from
``storage_options``, passed to ``gcsfs.GCSFileSystem`` as they are.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

from weightstream.errors import NotFound, SourceError
from weightstream.sources.dependencies import require
from weightstream.sources.http.transport import RangeTarget
from weightstream.sources.objects.hosts import check_endpoint
from weightstream.sources.objects.listing import ListedStore
from weightstream.sources.objects.versioned import RangeSource
from weightstream.sources.retry import RetryPolicy, Transient

VERSION_KEY = "generation"
"""The field of an object's metadata that names its version."""
GENERATION_HEADER = "x-goog-generation"
"""The header of a download answer that names the generation it holds."""


class GcsStore(ListedStore):
    """Lists and opens objects under ``gs://bucket/prefix``.

    Example:
        >>> store = GcsStore({"token": "anon"})  # doctest: +SKIP
        >>> store.open("gs://bench/model.safetensors").size  # doctest: +SKIP
        4096
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None) -> None:
        require("gs", "fsspec", "gcsfs")
        import fsspec

        # gcsfs 2025+ probes the bucket type over gRPC unless told not to; against emulators every call then hangs.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        # Before the filesystem: gcsfs looks for default credentials first (the metadata server, for seconds).
        check_endpoint("gs", _endpoint(storage_options or {}))
        # A filesystem of our own per store (not fsspec's shared instance), so that closing the store
        # closes its connections: nothing of a load outlives it. Version-aware, so reads can pin a generation.
        self.fs = fsspec.filesystem(
            "gcs", **{"version_aware": True, **(storage_options or {}), "skip_instance_cache": True}
        )
        super().__init__(policy)

    def range_target(self, source: RangeSource) -> RangeTarget:
        """The download URL of the pinned generation; its answers must name that generation."""
        url = self.fs.url(self._key(source.uri), generation=source.version)
        return RangeTarget(url, self.fs._get_headers({}), GENERATION_HEADER, source.version)

    def close(self) -> None:
        """Close this store's connections (range requests and the fsspec session); idempotent."""
        from fsspec.asyn import sync

        super().close()
        session = getattr(self.fs, "_session", None)
        if session is not None and not session.closed:
            sync(self.fs.loop, session.close)

    version_key = VERSION_KEY

    def _key(self, uri: str) -> str:
        return uri.split("://", 1)[1]

    def _metadata(self, uri: str, call: str, **options: Any) -> Any:
        return self._call(uri, getattr(self.fs, call), self._key(uri), **options)

    def _attempt_options(self) -> dict[str, Any]:
        """Each attempt bounded by the stall timeout (fsspec's ``sync()`` takes ``timeout``)."""
        return {"timeout": self.policy.timeout()}

    def _classify(self, uri: str, error: Exception) -> Exception:
        return classify(uri, error, self.policy.timeout())


def _endpoint(storage_options: Mapping[str, Any]) -> str:
    """The URL gcsfs will send requests to: ``endpoint_url``, else the emulator ``$STORAGE_EMULATOR_HOST`` names,
    else Google's (``gcsfs.core._location``'s rules, without its import).

    Example:
        >>> _endpoint({"endpoint_url": "http://127.0.0.1:4443"})
        'http://127.0.0.1:4443'
    """
    if storage_options.get("endpoint_url"):
        return str(storage_options["endpoint_url"])
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator not in ("", "default"):
        return emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}"
    return f"https://storage.{os.environ.get('GOOGLE_CLOUD_UNIVERSE_DOMAIN') or 'googleapis.com'}"


def classify(uri: str, error: Exception, timeout: float) -> Exception:
    """The error to raise (or :class:`Transient` to retry) for ``error`` from a gcsfs call on ``uri``.

    Transient: a 5xx, 408/429, a timeout, a broken connection. Not found and access denied are final;
    anything that is neither the store's nor the network's (a ``TypeError``: a programming error) is
    returned unchanged, never retried.

    Example:
        >>> classify("gs://b/k", TypeError("unexpected keyword"), 30.0)
        TypeError('unexpected keyword')
    """
    import aiohttp
    from fsspec.exceptions import FSTimeoutError

    if isinstance(error, FileNotFoundError):
        return NotFound(f"{uri}: no such object")
    if isinstance(error, PermissionError):
        return SourceError(f"{uri}: access denied: {error}")
    if isinstance(error, (FSTimeoutError, asyncio.TimeoutError, TimeoutError)):
        return Transient(f"no answer for {timeout:.1f} s (stalled)", stalled=True)
    status = getattr(error, "code", None)
    if isinstance(status, int):  # gcsfs's HttpError
        if status >= 500 or status in (408, 429):
            return Transient(f"HTTP {status}: {error}")
        if status in (401, 403):
            return SourceError(f"{uri}: access denied (HTTP {status}): {error}")
        return SourceError(f"{uri}: HTTP {status}: {error}")
    if isinstance(error, (ConnectionError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)):
        return Transient(f"{type(error).__name__}: {error}")
    return error
