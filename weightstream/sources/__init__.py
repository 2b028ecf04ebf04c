"""Where bytes live. Every source offers the same small interface (:class:`Source`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from weightstream.errors import UnsupportedInputError
from weightstream.sources.base import Source, Store
from weightstream.sources.retry import RetryPolicy

REMOTE_SCHEMES = ("s3://", "gs://", "gcs://", "az://", "abfs://", "oci://", "http://", "https://", "hf://")
"""URIs read over the network (an ``hf://`` id may be in the local cache: :func:`locate` says where it is)."""
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")

__all__ = ["Source", "Store", "locate", "store_for"]


def locate(
    uri: str, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None
) -> tuple[Store, str]:
    """The store that serves ``uri`` and where in it the checkpoint is: ``uri`` itself, except for an
    ``hf://`` model id, which names the Hugging Face cache's snapshot or the Hub's files at one commit.

    Example:
        >>> store, location = locate("/tmp")
        >>> type(store).__name__, location
        ('LocalStore', '/tmp')
    """
    if uri.startswith("hf://"):
        from weightstream.sources.hub import store as hub

        return hub.locate(uri, storage_options, policy)
    return store_for(uri, storage_options, policy), uri


def store_for(uri: str, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None) -> Store:
    """The store that serves ``uri`` (``storage_options`` go to an object store's filesystem, ``policy``
    says how its requests are retried).

    Example:
        >>> type(store_for("/tmp")).__name__
        'LocalStore'
    """
    scheme = _SCHEME.match(uri)
    if scheme is None or scheme[1] == "file":
        from weightstream.sources.local.file import LocalStore  # torch comes with it: not for `weightstream --help`

        return LocalStore()
    if uri.startswith(("http://", "https://")):
        from weightstream.sources.http.store import HttpStore

        return HttpStore(storage_options, policy)
    if uri.startswith("s3://"):
        from weightstream.sources.objects.s3 import S3Store

        return S3Store(storage_options, policy)
    if uri.startswith(("gs://", "gcs://")):
        from weightstream.sources.objects.gcs import GcsStore

        return GcsStore(storage_options, policy)
    if uri.startswith(("az://", "abfs://")):
        from weightstream.sources.objects.azure import AzureStore

        return AzureStore(storage_options, policy)
    if uri.startswith("oci://"):
        from weightstream.sources.oci.store import OciStore

        return OciStore(storage_options, policy)
    if scheme[1] == "hf":
        raise UnsupportedInputError(
            f"{uri}: an hf:// URI names a model, not a store: open it with weightstream.open or load_weights"
        )
    raise UnsupportedInputError(
        f"{uri}: {scheme[1]}:// URIs are not supported; use s3://, gs://, az://, oci://, http(s)://, hf://, a local "
        "path or file://"
    )
