"""Blobs in Azure Blob Storage (``az://container/path``, ``abfs://container/path``): metadata and listing through
fsspec's adlfs, tensor bytes through our own range client (:mod:`weightstream.sources.http.transport`), straight into
destination memory, as for S3 and GCS.

Every blob is pinned to the ETag seen when it was opened: ranges are fetched with ``If-Match``, so a blob
replaced mid-load answers 412 and the load fails with :class:`SourceChangedError`, never a splice. Range
requests carry a SAS: the one given (``sas_token``, or a connection string's ``SharedAccessSignature``), or
one made here for each blob from the account key (read-only, an hour long, made again after half of it), or
none for a public container (``anon=True``). Settings come from ``storage_options`` (adlfs's names:
``account_name``, ``account_key``, ``sas_token``, ``connection_string``, ``anon``, ``account_host``) or the
standard variables (``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_ACCOUNT_NAME``,
``AZURE_STORAGE_ACCOUNT_KEY``, ``AZURE_STORAGE_SAS_TOKEN``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import datetime
import os
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any, ClassVar

from weightstream.errors import InvalidOptionError, NotFound, SourceError
from weightstream.sources.dependencies import require
from weightstream.sources.http.transport import RangeTarget
from weightstream.sources.objects.hosts import check_endpoint
from weightstream.sources.objects.listing import ListedStore
from weightstream.sources.objects.versioned import RangeSource, known_options
from weightstream.sources.retry import RetryPolicy, Transient

STORAGE_OPTIONS = ("account_name", "account_key", "sas_token", "connection_string", "anon", "account_host")
"""What ``storage_options`` may hold for ``az://`` (adlfs's names)."""
ENVIRONMENT = {
    "connection_string": "AZURE_STORAGE_CONNECTION_STRING",
    "account_name": "AZURE_STORAGE_ACCOUNT_NAME",
    "account_key": "AZURE_STORAGE_ACCOUNT_KEY",
    "sas_token": "AZURE_STORAGE_SAS_TOKEN",
}
"""The standard variables, read where ``storage_options`` says nothing."""
API_VERSION = "2021-08-06"
"""The Blob service version range requests ask for."""
SAS_LIFETIME_S = 3600
"""SAS made here from the account key are valid this long, and made again after half of it."""
TRANSIENT_CODES = frozenset({"ServerBusy", "OperationTimedOut", "InternalError"})
"""Azure error codes worth another attempt, whatever the status says."""


@dataclasses.dataclass(frozen=True)
class AzureAccount:
    """Where an account's blobs are and how requests prove they may read them."""

    endpoint: str
    """The Blob service's URL, ``https://ACCOUNT.blob.core.windows.net`` (or a connection string's ``BlobEndpoint``)."""
    account_name: str | None
    account_key: str | None
    sas_token: str | None
    anonymous: bool

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> AzureAccount:
        """The account ``storage_options`` (or the standard variables) describe.

        Raises:
            InvalidOptionError: no account named, or a malformed connection string.

        Example:
            >>> AzureAccount.from_options({"account_name": "acct", "anon": True}).endpoint
            'https://acct.blob.core.windows.net'
        """
        settings = {name: options.get(name) for name in STORAGE_OPTIONS}
        if not any(settings[name] for name in ENVIRONMENT):
            settings.update({name: os.environ.get(variable) for name, variable in ENVIRONMENT.items()})
        fields: dict[str, str] = {}
        if settings["connection_string"]:
            fields = _connection_fields(str(settings["connection_string"]))
        name = settings["account_name"] or fields.get("AccountName")
        key = settings["account_key"] or fields.get("AccountKey")
        sas = settings["sas_token"] or fields.get("SharedAccessSignature")
        endpoint = fields.get("BlobEndpoint")
        if endpoint is None and settings["account_host"]:
            endpoint = f"https://{settings['account_host']}"
        if endpoint is None and name:
            suffix = fields.get("EndpointSuffix", "core.windows.net")
            endpoint = f"{fields.get('DefaultEndpointsProtocol', 'https')}://{name}.blob.{suffix}"
        if endpoint is None:
            raise InvalidOptionError(
                "az://: no storage account: give storage_options account_name (with account_key, sas_token or "
                "anon=True) or connection_string, or set AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME"
            )
        anonymous = bool(settings["anon"])
        if key:
            try:
                base64.b64decode(str(key), validate=True)
            except (binascii.Error, ValueError):
                raise InvalidOptionError(
                    f"az:// on {endpoint}: the account key is not base64 (copy it whole from the portal or "
                    "`az storage account keys list`)"
                ) from None
        if not (key or sas or anonymous):
            raise InvalidOptionError(
                f"az:// on {endpoint}: no credentials: give account_key, sas_token or a connection string holding "
                "either, or anon=True for a public container (Azure AD credentials are not supported yet)"
            )
        return cls(endpoint.rstrip("/"), name, key, str(sas).lstrip("?") if sas else None, anonymous)

    def filesystem_options(self) -> dict[str, Any]:
        """adlfs's options for the same account."""
        options: dict[str, Any] = {"account_name": self.account_name or _account_of(self.endpoint)}
        host = urllib.parse.urlsplit(self.endpoint)
        if self.account_key:
            options["account_key"] = self.account_key
        if self.sas_token:
            options["sas_token"] = self.sas_token
        if self.anonymous:
            options["anon"] = True
        if not host.netloc.startswith(f"{options['account_name']}.blob."):
            # An emulator or a custom domain: adlfs reaches it through a connection string.
            secret = (
                f"AccountKey={self.account_key};"
                if self.account_key
                else f"SharedAccessSignature={self.sas_token};"
                if self.sas_token
                else ""
            )
            connection = f"DefaultEndpointsProtocol={host.scheme};AccountName={options['account_name']};{secret}"
            options = {"connection_string": f"{connection}BlobEndpoint={self.endpoint};"}
        return options


class AzureStore(ListedStore):
    """Lists and opens blobs under ``az://container/prefix`` (or ``abfs://``).

    Example:
        >>> store = AzureStore({"connection_string": "...;BlobEndpoint=http://127.0.0.1:10000/acct;"})  # doctest: +SKIP
        >>> store.open("az://models/llama/model.safetensors").size  # doctest: +SKIP
        4096
    """

    version_key = "etag"
    noun = "blob"
    fresh_listing: ClassVar[dict[str, Any]] = {"invalidate_cache": True}

    def __init__(self, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None) -> None:
        require("az", "fsspec", "adlfs", "azure-storage-blob")
        import fsspec

        options = known_options("az", storage_options, STORAGE_OPTIONS)
        self.account = AzureAccount.from_options(options)
        check_endpoint("az", self.account.endpoint)
        # A filesystem of our own per store (not fsspec's shared instance), so that closing the store closes
        # its connections: nothing of a load outlives it.
        self.fs = fsspec.filesystem("az", **self.account.filesystem_options(), skip_instance_cache=True)
        super().__init__(policy)
        self._signatures: dict[str, tuple[str, float]] = {}
        """Blob path -> the SAS made for it from the account key, and when."""
        self._signing = threading.Lock()
        self._closed = False

    def range_target(self, source: RangeSource) -> RangeTarget:
        """The blob's URL with its SAS; ``If-Match`` its pinned ETag, and answers must name it."""
        path = self._path(source.uri)
        url = f"{self.account.endpoint}/{urllib.parse.quote(path)}"
        sas = self._sas(path)
        headers = {"x-ms-version": API_VERSION, "If-Match": source.version}
        return RangeTarget(f"{url}?{sas}" if sas else url, headers, "ETag", source.version)

    def close(self) -> None:
        """Close this store's connections (range requests and adlfs's clients); idempotent."""
        from fsspec.asyn import sync

        super().close()
        if not self._closed:
            self._closed = True
            sync(self.fs.loop, self.fs.service_client.close)  # adlfs closes it again at garbage collection: a no-op

    def _sas(self, path: str) -> str | None:
        """The SAS for reading blob ``path``: the one given, one made from the account key, or None (anonymous)."""
        if self.account.sas_token:
            return self.account.sas_token
        if not self.account.account_key:
            return None
        with self._signing:
            made = self._signatures.get(path)
            if made is None or time.monotonic() - made[1] > SAS_LIFETIME_S / 2:
                made = self._signatures[path] = (self._make_sas(path), time.monotonic())
            return made[0]

    def _make_sas(self, path: str) -> str:
        from azure.storage.blob import BlobSasPermissions, generate_blob_sas

        container, _, blob = path.partition("/")
        now = datetime.datetime.now(datetime.timezone.utc)
        return generate_blob_sas(
            account_name=self.account.account_name or _account_of(self.account.endpoint),
            container_name=container,
            blob_name=blob,
            account_key=self.account.account_key,
            permission=BlobSasPermissions(read=True),
            start=now - datetime.timedelta(minutes=5),  # clocks differ
            expiry=now + datetime.timedelta(seconds=SAS_LIFETIME_S),
        )

    def _path(self, uri: str) -> str:
        """``container/blob`` of an ``az://`` or ``abfs://`` URI, ``abfs://container@account.dfs.core.windows.net/blob``
        included (its account must be the one the options name).

        Raises:
            InvalidOptionError: an ``abfs://`` URI naming another account.
        """
        rest = uri.split("://", 1)[1]
        head, slash, tail = rest.partition("/")
        if "@" not in head:
            return rest
        container, _, host = head.partition("@")
        account = host.split(".", 1)[0]
        configured = self.account.account_name or _account_of(self.account.endpoint)
        if account != configured:
            raise InvalidOptionError(
                f"{uri}: names account {account!r}, but the storage options are for {configured!r}"
            )
        return container + slash + tail

    def _metadata(self, uri: str, call: str, **options: Any) -> Any:
        """adlfs's coroutine of ``call``, run on its loop, each attempt bounded by the stall timeout and retried as
        :func:`classify` says (adlfs's synchronous methods take no timeout)."""
        from fsspec.asyn import sync

        coroutine = getattr(self.fs, f"_{call}")
        return self._call(
            uri, lambda: sync(self.fs.loop, coroutine, self._path(uri), timeout=self.policy.timeout(), **options)
        )

    def _classify(self, uri: str, error: Exception) -> Exception:
        return classify(uri, error, self.policy.timeout())


def classify(uri: str, error: Exception, timeout: float) -> Exception:
    """The error to raise (or :class:`Transient` to retry) for ``error`` from an adlfs call on ``uri``.

    Transient: a 5xx, 408/429, ``ServerBusy``/``OperationTimedOut``, a timeout, a broken connection. Not found
    and access denied are final; anything that is neither the store's nor the network's (a ``TypeError``: a
    programming error) is returned unchanged, never retried.

    Example:
        >>> classify("az://c/b", TypeError("unexpected keyword"), 30.0)
        TypeError('unexpected keyword')
    """
    import aiohttp
    from azure.core import exceptions as azure_errors
    from fsspec.exceptions import FSTimeoutError

    if isinstance(error, (FileNotFoundError, azure_errors.ResourceNotFoundError)):
        return NotFound(f"{uri}: no such blob or container")
    if isinstance(error, (FSTimeoutError, asyncio.TimeoutError, TimeoutError)):
        return Transient(f"no answer for {timeout:.1f} s (stalled)", stalled=True)
    if isinstance(error, azure_errors.HttpResponseError):
        status, code = error.status_code or 0, str(getattr(error.error_code, "value", error.error_code) or "")
        if status >= 500 or status in (408, 429) or code in TRANSIENT_CODES:
            return Transient(f"HTTP {status} {code}".rstrip())
        if status in (401, 403) or isinstance(error, azure_errors.ClientAuthenticationError):
            return SourceError(f"{uri}: access denied (HTTP {status} {code})".rstrip())
        return SourceError(f"{uri}: HTTP {status} {code}: {error.message}")
    if isinstance(error, PermissionError):
        return SourceError(f"{uri}: access denied: {error}")
    if isinstance(
        error,
        (
            ConnectionError,
            aiohttp.ClientConnectionError,
            aiohttp.ClientPayloadError,
            azure_errors.ServiceRequestError,
            azure_errors.ServiceResponseError,
        ),
    ):
        return Transient(f"{type(error).__name__}: {error}")
    return error


def _connection_fields(text: str) -> dict[str, str]:
    """A connection string's ``Name=value`` fields.

    Example:
        >>> _connection_fields("AccountName=a;AccountKey=k==;")
        {'AccountName': 'a', 'AccountKey': 'k=='}
    """
    fields = {}
    for part in text.split(";"):
        if not part.strip():
            continue
        name, equals, value = part.partition("=")
        if not equals:
            raise InvalidOptionError(f"a connection string's fields are Name=value; got {part[:40]!r}")
        fields[name.strip()] = value.strip()
    return fields


def _account_of(endpoint: str) -> str:
    """The account of an endpoint URL: its host's first label, or (an emulator) the path's first segment."""
    parts = urllib.parse.urlsplit(endpoint)
    path = parts.path.strip("/")
    return path.split("/")[0] if path else parts.netloc.split(".")[0]
