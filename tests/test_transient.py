"""Which failures are retried: transport and server errors only. A programming error (``TypeError``, as an
old s3fs raised for an argument it did not know) is raised at once, never retried as if it were the network."""

from __future__ import annotations

import re
import time

import botocore.exceptions
import pytest
from gcsfs.retry import HttpError

import weightstream
from weightstream.errors import NotFound, SourceError
from weightstream.sources.objects import gcs, s3
from weightstream.sources.retry import RetryPolicy, Transient


def client_error(status: int, code: str) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": "said the server"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "HeadObject",
    )


@pytest.mark.parametrize(
    ("error", "kind", "message"),
    [
        (client_error(503, "SlowDown"), Transient, r"HTTP 503 SlowDown"),
        (client_error(500, "InternalError"), Transient, r"HTTP 500 InternalError"),
        (client_error(429, "TooManyRequests"), Transient, r"HTTP 429"),
        (client_error(400, "RequestTimeout"), Transient, r"HTTP 400 RequestTimeout"),
        (client_error(404, "NoSuchKey"), NotFound, r"s3://b/k: no such object or bucket \(HTTP 404 NoSuchKey\)"),
        (client_error(403, "AccessDenied"), SourceError, r"s3://b/k: access denied \(HTTP 403 AccessDenied\)"),
        (client_error(400, "InvalidArgument"), SourceError, r"s3://b/k: HTTP 400 InvalidArgument: said the server"),
        (botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"), Transient, r"stalled"),
        (botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"), Transient, r"EndpointConnectionError"),
        (ConnectionResetError(104, "reset"), Transient, r"ConnectionResetError"),
        (botocore.exceptions.NoCredentialsError(), SourceError, r"no AWS credentials found"),
    ],
)
def test_s3_failures_are_classified(error, kind, message):
    classified = s3.classify("s3://b/k", error)
    assert type(classified) is kind
    assert re.search(message, str(classified)), str(classified)


@pytest.mark.parametrize(
    ("error", "kind", "message"),
    [
        (HttpError({"code": 503, "message": "backend"}), Transient, r"HTTP 503"),
        (HttpError({"code": 429, "message": "rate"}), Transient, r"HTTP 429"),
        (HttpError({"code": 403, "message": "no"}), SourceError, r"gs://b/k: access denied \(HTTP 403\)"),
        (HttpError({"code": 400, "message": "bad"}), SourceError, r"gs://b/k: HTTP 400"),
        (FileNotFoundError("b/k"), NotFound, r"gs://b/k: no such object"),
        (TimeoutError(), Transient, r"stalled"),
        (ConnectionResetError(104, "reset"), Transient, r"ConnectionResetError"),
    ],
)
def test_gcs_failures_are_classified(error, kind, message):
    classified = gcs.classify("gs://b/k", error, 30.0)
    assert type(classified) is kind
    assert re.search(message, str(classified)), str(classified)


@pytest.mark.parametrize(
    "bug",
    [
        TypeError("S3FileSystem.exists() got an unexpected keyword argument 'timeout'"),
        AttributeError("x"),
        KeyError("y"),
    ],
)
def test_programming_errors_are_not_transient(bug):
    assert s3.classify("s3://b/k", bug) is bug
    assert gcs.classify("gs://b/k", bug, 30.0) is bug


def test_a_type_error_in_a_metadata_call_is_raised_after_one_attempt():
    store = s3.S3Store({"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}, RetryPolicy(retries=5))
    calls = []

    def buggy(**kwargs):
        calls.append(kwargs)
        raise TypeError("head_object() got an unexpected keyword argument 'timeout'")

    try:
        start = time.monotonic()
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'timeout'"):
            store._call("s3://b/k", buggy, Bucket="b")
        assert len(calls) == 1 and time.monotonic() - start < 1
    finally:
        store.close()


def test_a_server_error_is_retried_then_reported(no_leaks):
    store = s3.S3Store({"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}, RetryPolicy(retries=2))
    calls = []

    def overloaded(**kwargs):
        calls.append(kwargs)
        raise client_error(503, "SlowDown")

    try:
        with pytest.raises(SourceError, match=r"s3://b/k: gave up after 3 attempt\(s\): HTTP 503 SlowDown"):
            store._call("s3://b/k", overloaded)
        assert len(calls) == 3
    finally:
        store.close()


def test_an_unknown_host_is_not_retried(no_leaks):
    start = time.monotonic()
    with pytest.raises(SourceError, match=r"no-such-host.invalid: no such host \(Name or service not known\)"):
        weightstream.load_weights("http://no-such-host.invalid/model.safetensors", retries=5)
    assert time.monotonic() - start < 3


def test_unknown_storage_options_for_s3_are_refused():
    with pytest.raises(
        weightstream.InvalidOptionError, match=r"storage_options for s3:// take endpoint_url, key, .*; got endpoint"
    ):
        s3.S3Store({"endpoint": "http://x"})
