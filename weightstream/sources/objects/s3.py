"""Objects in S3 (and S3-compatible stores): metadata and presigned URLs through botocore, tensor bytes
through our own range client (:mod:`weightstream.sources.http.transport`), straight into destination memory.

botocore, not s3fs: s3fs runs on aiobotocore, which pins botocore to a narrow range of releases, so
beside any boto3 (vLLM's images, Run:ai's S3 streamer) pip often cannot resolve both, or backtracks
for minutes; botocore alone always installs beside boto3, and imports in a third of s3fs's time.

Every object is pinned to the ETag seen when it was opened: ranges are fetched with ``If-Match``,
so an object replaced mid-load fails its read with :class:`SourceChangedError`, never a splice.
Endpoint, region and credentials come from botocore's standard chain (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, profiles, instance roles, ...) or from ``storage_options``.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Mapping
from typing import Any

from weightstream.errors import InvalidOptionError, NotFound, SourceError
from weightstream.sources.dependencies import require
from weightstream.sources.http.transport import RangeTarget
from weightstream.sources.objects.hosts import check_endpoint
from weightstream.sources.objects.versioned import RangeSource, RemoteStore, known_options
from weightstream.sources.retry import RetryPolicy, Transient

STORAGE_OPTIONS = (
    "endpoint_url",
    "key",
    "secret",
    "token",
    "region_name",
    "profile",
    "anon",
    "client_kwargs",
    "config_kwargs",
)
"""What ``storage_options`` may hold for ``s3://`` (s3fs's names for the same settings, so existing options keep
working)."""
PRESIGNED_LIFETIME_S = 3600
"""Presigned URLs are valid this long, and made again after half of it."""
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "OperationAborted",
    }
)
"""S3 error codes worth another attempt, whatever the status says."""
MISSING_CODES = frozenset({"404", "NoSuchKey", "NoSuchBucket", "NotFound"})
DENIED_CODES = frozenset(
    {"401", "403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
)


class S3Store(RemoteStore):
    """Lists and opens objects under ``s3://bucket/prefix``.

    Example:
        >>> store = S3Store({"endpoint_url": "http://127.0.0.1:8333"})  # doctest: +SKIP
        >>> store.open("s3://bench/model.safetensors").size  # doctest: +SKIP
        4096
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None) -> None:
        require("s3", "botocore")
        options = known_options("s3", storage_options, STORAGE_OPTIONS)
        super().__init__(policy)
        self.client = _client(options, self.policy)
        check_endpoint("s3", self.client.meta.endpoint_url)
        self._presigned: dict[str, tuple[str, float]] = {}
        self._presigning = threading.Lock()
        self._listed: dict[str, dict[str, Any]] = {}
        """URI -> what a listing this store made said of it (a load's snapshot; reads stay pinned to its ETags)."""

    def is_dir(self, uri: str) -> bool:
        listed = self._listed.get(uri.rstrip("/"))
        if listed is not None:
            return listed["type"] == "directory"
        bucket, key = _bucket_and_key(uri)
        if not key:
            self._call(uri, self.client.head_bucket, Bucket=bucket)
            return True
        answer = self._call(uri, self.client.list_objects_v2, Bucket=bucket, Prefix=key.rstrip("/") + "/", MaxKeys=1)
        return answer.get("KeyCount", 0) > 0

    def exists(self, uri: str) -> bool:
        if uri.rstrip("/") in self._listed:
            return True
        _bucket, key = _bucket_and_key(uri)
        if key and not uri.endswith("/"):
            try:
                self._head(uri)
                return True
            except NotFound:
                pass
        try:
            return self.is_dir(uri)
        except NotFound:
            return False

    def list_names(self, uri: str) -> list[str]:
        """The entries of prefix ``uri``; what the listing says of each (type, size, ETag) answers later
        questions about them in this store without another request."""
        bucket, key = _bucket_and_key(uri)
        prefix = key.rstrip("/") + "/" if key else ""
        names = []
        token = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = self._call(uri, self.client.list_objects_v2, Bucket=bucket, Prefix=prefix, Delimiter="/", **extra)
            for entry in page.get("Contents", []):
                name = entry["Key"][len(prefix) :]
                if name:
                    self._listed[self.join(uri, name)] = {
                        "type": "file",
                        "size": entry["Size"],
                        "etag": entry.get("ETag"),
                    }
                    names.append(name)
            for entry in page.get("CommonPrefixes", []):
                name = entry["Prefix"][len(prefix) :].rstrip("/")
                self._listed[self.join(uri, name)] = {"type": "directory"}
                names.append(name)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(names)

    def open(self, uri: str, *, direct: bool | str = False) -> RangeSource:
        """Open ``uri`` at its current ETag (``direct`` has no meaning for objects and is ignored)."""
        listed = self._listed.get(uri.rstrip("/"))
        if listed is not None and listed["type"] == "directory":
            raise NotFound(f"{uri}: is a prefix, not an object")
        if listed is None or not listed.get("etag"):
            answer = self._head(uri, ChecksumMode="ENABLED")
            listed = {"size": answer["ContentLength"], "etag": answer.get("ETag"), "sha256": whole_sha256(answer)}
        if not listed["etag"]:
            raise SourceError(f"{uri}: the store gave no ETag, so reads cannot be pinned to one version")
        return RangeSource(self, uri, int(listed["size"]), str(listed["etag"]), listed.get("sha256"))

    def range_target(self, source: RangeSource) -> RangeTarget:
        """A presigned GET URL of the object, ``If-Match: <ETag>``, and answers that must carry that ETag."""
        return RangeTarget(self._presigned_url(source.uri), {"If-Match": source.version}, "ETag", source.version)

    def close(self) -> None:
        """Close this store's connections (range requests and botocore's pool); idempotent."""
        super().close()
        self.client.close()

    def _head(self, uri: str, **options: str) -> dict[str, Any]:
        bucket, key = _bucket_and_key(uri)
        return self._call(uri, self.client.head_object, Bucket=bucket, Key=key, **options)

    def _presigned_url(self, uri: str) -> str:
        with self._presigning:
            url, made = self._presigned.get(uri, ("", -PRESIGNED_LIFETIME_S))
            if time.monotonic() - made > PRESIGNED_LIFETIME_S / 2:
                bucket, key = _bucket_and_key(uri)
                url = self.client.generate_presigned_url(
                    "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=PRESIGNED_LIFETIME_S
                )
                self._presigned[uri] = (url, time.monotonic())
            return url

    def _classify(self, uri: str, error: Exception) -> Exception:
        return classify(uri, error)


def classify(uri: str, error: Exception) -> Exception:
    """The error to raise (or :class:`Transient` to retry) for ``error`` from a botocore call on ``uri``.

    Transient: a 5xx, a throttling code, 408/429, a timeout, a broken or refused connection. Not
    found, access denied and other client errors are final; anything that is neither botocore's nor
    the network's (a ``TypeError``: a programming error) is returned unchanged, never retried.

    Example:
        >>> classify("s3://b/k", TypeError("unexpected keyword"))
        TypeError('unexpected keyword')
    """
    import botocore.exceptions as failures

    if isinstance(error, failures.ClientError):
        details = error.response.get("Error", {})
        code = str(details.get("Code", ""))
        status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        said = f"HTTP {status} {code}".strip()
        if code in MISSING_CODES or status == 404:
            return NotFound(f"{uri}: no such object or bucket ({said})")
        if code in DENIED_CODES or status in (401, 403):
            return SourceError(f"{uri}: access denied ({said})")
        if code in TRANSIENT_CODES or status >= 500 or status in (408, 429):
            return Transient(said)
        return SourceError(f"{uri}: {said}: {details.get('Message', '')}")
    if isinstance(error, (failures.ReadTimeoutError, failures.ConnectTimeoutError, TimeoutError)):
        return Transient(f"no answer within the timeout (stalled): {error}", stalled=True)
    if isinstance(error, (failures.HTTPClientError, failures.ConnectionError, ConnectionError)):
        return Transient(f"{type(error).__name__}: {error}")
    if isinstance(error, failures.NoCredentialsError):
        return SourceError(
            f"{uri}: no AWS credentials found (storage_options key/secret, AWS_ACCESS_KEY_ID, a profile or a role)"
        )
    if isinstance(error, failures.BotoCoreError):
        return SourceError(f"{uri}: {type(error).__name__}: {error}")
    return error


def _client(options: dict[str, Any], policy: RetryPolicy) -> Any:
    """A botocore S3 client: one attempt per call (our loop retries), the stall timeout on every socket."""
    import botocore.config
    import botocore.session
    from botocore import UNSIGNED

    session = botocore.session.Session(profile=options.get("profile"))
    if options.get("key") or options.get("secret"):
        session.set_credentials(options.get("key"), options.get("secret"), options.get("token"))
    config_kwargs = {
        "retries": {"max_attempts": 1, "mode": "standard"},
        "connect_timeout": policy.request_timeout_s,
        "read_timeout": policy.request_timeout_s,
        **(options.get("config_kwargs") or {}),
    }
    if options.get("anon"):
        config_kwargs["signature_version"] = UNSIGNED
    client_kwargs = dict(options.get("client_kwargs") or {})
    if options.get("endpoint_url"):
        client_kwargs["endpoint_url"] = options["endpoint_url"]
    region = (
        options.get("region_name")
        or client_kwargs.pop("region_name", None)
        or session.get_config_variable("region")
        or "us-east-1"
    )
    return session.create_client(
        "s3", region_name=region, config=botocore.config.Config(**config_kwargs), **client_kwargs
    )


def whole_sha256(head: dict[str, Any]) -> str | None:
    """The hex sha256 of a whole object from a HEAD's ``ChecksumSHA256`` (asked with ``ChecksumMode=ENABLED``); None
    where there is none, or where it is a multipart upload's checksum of its parts' checksums (``...-N``).

    Example:
        >>> whole_sha256({"ChecksumSHA256": "RPg1RJSlugO6F5Ko0+nFNMR6kYGYD956P0SwbvKufH8="})[:16]
        '44f8354494a5ba03'
        >>> whole_sha256({"ChecksumSHA256": "RPg1RJSlugO6F5Ko0+nFNMR6kYGYD956P0SwbvKufH8=-3"}) is None
        True
    """
    checksum = head.get("ChecksumSHA256")
    if not checksum or "-" in checksum or head.get("ChecksumType") == "COMPOSITE":
        return None
    return base64.b64decode(checksum).hex()


def _bucket_and_key(uri: str) -> tuple[str, str]:
    """``s3://bucket/key/of/object`` -> ``("bucket", "key/of/object")``."""
    path = uri.split("://", 1)[1]
    bucket, _, key = path.partition("/")
    if not bucket:
        raise InvalidOptionError(f"{uri}: an s3:// URI names a bucket: s3://bucket/prefix")
    return bucket, key
