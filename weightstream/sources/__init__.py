"""Where bytes live. Every source offers the same small interface (:class:`Source`)."""

from __future__ import annotations

from weightstream.errors import UnsupportedInputError
from weightstream.sources.base import Source, Store
from weightstream.sources.local import LocalStore

REMOTE_SCHEMES = ("s3://", "gs://", "gcs://", "http://", "https://")

__all__ = ["Source", "Store", "store_for"]


def store_for(uri: str) -> Store:
    """The store that serves ``uri``.

    Example:
        >>> type(store_for("/tmp")).__name__
        'LocalStore'
    """
    if uri.startswith(REMOTE_SCHEMES):
        scheme = uri.split("://", 1)[0]
        raise UnsupportedInputError(f"{uri}: {scheme}:// URIs are not supported by this version of weightstream; use a local path")
    return LocalStore()
