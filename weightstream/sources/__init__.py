"""Where bytes live. Every source offers the same small interface (:class:`Source`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightstream.errors import UnsupportedInputError
from weightstream.sources.base import Source, Store
from weightstream.sources.http import HttpStore
from weightstream.sources.local import LocalStore
from weightstream.sources.objectstore import PROTOCOLS, ObjectStore
from weightstream.sources.retry import RetryPolicy

REMOTE_SCHEMES = ("s3://", "gs://", "gcs://", "http://", "https://")

__all__ = ["Source", "Store", "store_for"]


def store_for(uri: str, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None) -> Store:
    """The store that serves ``uri`` (``storage_options`` go to an object store's filesystem, ``policy``
    says how its requests are retried).

    Example:
        >>> type(store_for("/tmp")).__name__
        'LocalStore'
    """
    if uri.startswith(("http://", "https://")):
        return HttpStore(storage_options, policy)
    if uri.startswith(REMOTE_SCHEMES):
        scheme = uri.split("://", 1)[0]
        if scheme not in PROTOCOLS:
            raise UnsupportedInputError(f"{uri}: {scheme}:// URIs are not supported; use s3://, gs://, http(s):// or a local path")
        return ObjectStore(scheme, storage_options, policy)
    return LocalStore()
