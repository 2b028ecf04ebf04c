"""Faults between weightstream and a real object-store server, injected by a proxy on loopback:
every case ends in a bit-exact load or the documented typed error, with nothing leaked."""

from __future__ import annotations

import contextlib
import re
import time

import pytest

import weightstream
from tests.conftest import assert_same, save_hf_sharded
from tests.faultproxy import FaultProxy
from tests.objstore import azure_connection_string
from tests.test_objectstore import upload
from weightstream.bench.demo import LlamaShape, llama_state_dict

pytestmark = pytest.mark.slow

MIB = 1 << 20
SHAPE = LlamaShape(hidden=256, intermediate=704, layers=2, vocab=2000)  # shards of about 1.5 MiB
DATA_GET = (
    r"^GET (/download/storage/v1/b/bench/o/|/bench/|/buckets/bench/|/devstoreaccount1/bench/).*model-00001-of-00002"
)
"""Range GETs of the first shard's bytes (S3 paths, GCS download URLs, the HTTP filer, Azure blob URLs; not GCS
metadata GETs)."""
ENDPOINTS = {"s3": "s3_endpoint", "gs": "gcs_endpoint", "http": "s3_endpoint", "az": "azure_endpoint"}


@pytest.fixture(params=list(ENDPOINTS))
def faulty(request, tmp_path_factory):
    """(uri, state, proxy) for a checkpoint behind a fault proxy, per object store (and plain HTTP)."""
    scheme = request.param
    endpoint = request.getfixturevalue(ENDPOINTS[scheme])
    state = llama_state_dict(SHAPE, seed=3)
    uri = upload(
        "s3" if scheme == "http" else scheme,
        save_hf_sharded(state, tmp_path_factory.mktemp("faults") / "ckpt", shards=2),
        f"faults-{scheme}",
    )
    upstream = request.getfixturevalue("http_base") if scheme == "http" else endpoint
    with FaultProxy(int(upstream.split(":")[2].split("/")[0])) as proxy:
        if scheme == "http":
            uri = f"{proxy.url}/buckets/bench/faults-http"
        yield uri, state, proxy


def load_through(proxy: FaultProxy, uri: str, inject=None, **options) -> dict:
    """Plan through the proxy, then inject the faults (so they hit tensor data), then read."""
    through = {
        "http": {},
        "az": {"storage_options": {"connection_string": azure_connection_string(proxy.url)}},
    }.get(uri.split(":")[0], {"storage_options": {"endpoint_url": proxy.url}})
    options = {**through, "chunk_bytes": 1 << 20, "threads": 2, **options}
    stream = weightstream.iter_weights(uri, **options)
    if inject is not None:
        inject()
    with contextlib.closing(stream):
        return dict(stream)


def data_gets(proxy: FaultProxy) -> list[tuple[str, str | None]]:
    return [(line, ranges) for line, ranges in proxy.requests if re.search(DATA_GET, line)]


def test_slowdown_answers_are_retried(faulty, no_leaks):
    uri, state, proxy = faulty
    loaded = load_through(proxy, uri, lambda: proxy.inject(DATA_GET, "503", times=3))
    assert_same(loaded, state)


def test_a_reset_range_resumes_from_the_byte_reached(faulty, no_leaks):
    uri, state, proxy = faulty
    faults = []
    loaded = load_through(
        proxy,
        uri,
        lambda: faults.append(proxy.inject(DATA_GET, "reset", times=2, after_bytes=300_000, min_range_bytes=MIB // 2)),
        threads=1,
    )
    assert_same(loaded, state)
    asked = [span(ranges) for _, ranges in data_gets(proxy) if ranges]
    assert len(faults[0].hits) == 2
    for broken in map(span, faults[0].hits):
        resumed = min((start for start, end in asked if end == broken[1] and start > broken[0]), default=None)
        # It resumes where the bytes stopped: past the start, by at most what the proxy let through.
        assert resumed is not None and resumed - broken[0] <= 300_000, (broken, asked)


def test_a_short_body_is_resumed(faulty, no_leaks):
    uri, state, proxy = faulty
    faults = []
    loaded = load_through(
        proxy,
        uri,
        lambda: faults.append(proxy.inject(DATA_GET, "short", times=2, after_bytes=300_000, min_range_bytes=MIB // 2)),
        threads=1,
    )
    assert_same(loaded, state)
    assert len(faults[0].hits) == 2


def test_a_whole_object_where_a_range_was_asked_is_an_error_not_data(faulty, no_leaks):
    uri, _, proxy = faulty
    with pytest.raises(
        weightstream.SourceError,
        match=r"model-00001-of-00002.safetensors: range \d+\.\.\d+: answered 200 with the whole object, not 206",
    ):
        load_through(proxy, uri, lambda: proxy.inject(DATA_GET, "whole", times=1))


def span(ranges: str) -> tuple[int, int]:
    start, end = ranges.split("=")[1].split("-")
    return int(start), int(end)


def test_a_stalled_range_is_retried_after_the_request_timeout(faulty, no_leaks):
    uri, state, proxy = faulty
    start = time.monotonic()
    faults = []
    loaded = load_through(
        proxy,
        uri,
        lambda: faults.append(proxy.inject(DATA_GET, "stall", times=1, after_bytes=100_000, min_range_bytes=MIB // 2)),
        request_timeout_s=1.0,
    )
    assert_same(loaded, state)
    assert len(faults[0].hits) == 1
    assert time.monotonic() - start >= 1.0


def test_giving_up_names_the_object_and_range(faulty, no_leaks):
    uri, _, proxy = faulty
    with pytest.raises(
        weightstream.SourceError,
        match=rf"{re.escape(uri)}/model-00001-of-00002.safetensors: range \d+\.\.\d+: gave up after 3 attempt\(s\): ",
    ):
        load_through(proxy, uri, lambda: proxy.inject(DATA_GET, "503", times=100), retries=2)


def test_the_deadline_ends_a_stalled_load(faulty, no_leaks):
    uri, _, proxy = faulty
    start = time.monotonic()
    with pytest.raises(weightstream.SourceTimeout, match=r"deadline|stalled"):
        load_through(
            proxy, uri, lambda: proxy.inject(r"^GET ", "stall", times=100), deadline_s=2.0, request_timeout_s=30.0
        )
    assert time.monotonic() - start < 10


def test_bad_credentials_are_not_retried(faulty, no_leaks):
    uri, _, proxy = faulty
    if not uri.startswith(("s3://", "az://")):
        pytest.skip("the GCS emulator and the HTTP filer do not check credentials")
    before = len(proxy.requests)
    wrong = (
        {"endpoint_url": proxy.url, "key": "testing", "secret": "wrong"}
        if uri.startswith("s3://")
        else {"connection_string": azure_connection_string(proxy.url).replace("AccountKey=Eby8", "AccountKey=Xby8")}
    )
    with pytest.raises(
        weightstream.SourceError,
        match=r"access denied|AccessDenied|SignatureDoesNotMatch|InvalidAccessKeyId|AuthorizationFailure",
    ) as refused:
        weightstream.load_weights(uri, storage_options=wrong)
    assert len(proxy.requests) - before <= 2, proxy.requests[before:]
    assert "Xby8" not in str(refused.value)
