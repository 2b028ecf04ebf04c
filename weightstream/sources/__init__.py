"""Where bytes live. Every source offers the same small interface (:class:`Source`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from weightstream.errors import UnsupportedInputError
from weightstream.sources.base import Source, Store
from weightstream.sources.local import LocalStore
from weightstream.sources.retry import RetryPolicy

REMOTE_SCHEMES = ("s3://", "gs://", "gcs://", "http://", "https://")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")

__all__ = ["Source", "Store", "store_for"]


def store_for(uri: str, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None) -> Store:
    """The store that serves ``uri`` (``storage_options`` go to an object store's filesystem, ``policy``
    says how its requests are retried).

    Example:
        >>> type(store_for("/tmp")).__name__
        'LocalStore'
    """
    scheme = _SCHEME.match(uri)
    if scheme is None or scheme[1] == "file":
        return LocalStore()
    if uri.startswith(("http://", "https://")):
        from weightstream.sources.http import HttpStore

        return HttpStore(storage_options, policy)
    if uri.startswith("s3://"):
        from weightstream.sources.s3 import S3Store

        return S3Store(storage_options, policy)
    if uri.startswith(("gs://", "gcs://")):
        from weightstream.sources.gcs import GcsStore

        return GcsStore(storage_options, policy)
    raise UnsupportedInputError(f"{uri}: {scheme[1]}:// URIs are not supported; use s3://, gs://, http(s)://, a local path or file://")
