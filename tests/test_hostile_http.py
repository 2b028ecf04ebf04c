"""http(s):// against a server that misbehaves (tests/rangeserver.py): each case a typed error in bounded
time and memory, or, for what a server may legitimately do (query strings), a bit-exact load."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import psutil
import pytest

import weightstream
from tests.conftest import assert_same, raw_file, save_hf_sharded
from tests.rangeserver import RangeServer, replace_file
from weightstream.bench.demo import LlamaShape, llama_state_dict

SHAPE = LlamaShape(hidden=128, intermediate=352, layers=2, vocab=500)


@pytest.fixture
def checkpoint(tmp_path: Path):
    """(server, state) serving a two-shard checkpoint with an index from a fresh directory."""
    state = llama_state_dict(SHAPE, seed=1)
    root = save_hf_sharded(state, tmp_path / "root", shards=2)
    with RangeServer(root) as server:
        yield server, state


def test_query_strings_are_kept_and_ignored_in_names(checkpoint, no_leaks):
    server, state = checkpoint
    assert_same(weightstream.load_weights(f"{server.url}/?download=true", chunk_bytes=64 << 10), state)
    assert all("?download=true" in line for line in server.requests if line.startswith(("GET", "HEAD")))
    weight_map = json.loads((server.root / "model.safetensors.index.json").read_text())["weight_map"]
    first_shard = {
        name: state[name] for name, shard in weight_map.items() if shard == "model-00001-of-00002.safetensors"
    }
    assert_same(
        weightstream.load_weights(f"{server.url}/model-00001-of-00002.safetensors?X-Signature=abc"), first_shard
    )
    assert server.requests[-1].startswith("GET /model-00001-of-00002.safetensors?X-Signature=abc ")


def test_a_server_ignoring_if_match_cannot_splice_a_replaced_file(checkpoint, no_leaks):
    server, _ = checkpoint
    server.misbehave.honour_if_match = False
    shard = server.root / "model-00001-of-00002.safetensors"
    stream = weightstream.iter_weights(server.url, chunk_bytes=64 << 10, threads=1)  # headers read: ETags pinned
    other = save_hf_sharded(llama_state_dict(SHAPE, seed=2), server.root.parent / "v2", shards=2)
    replace_file(shard, (other / shard.name).read_bytes())  # same size, other bytes
    with pytest.raises(
        weightstream.SourceChangedError,
        match=r"the answer is of version \"[0-9a-f]+\" \(ETag\), \"[0-9a-f]+\" when it was opened \(replaced while "
        r"loading\)",
    ):
        dict(stream)


def test_content_range_total_other_than_the_size_is_a_changed_source(checkpoint, no_leaks):
    server, _ = checkpoint
    stream = weightstream.iter_weights(server.url, chunk_bytes=64 << 10)
    server.misbehave.content_range_total = 123
    with pytest.raises(
        weightstream.SourceChangedError, match=r"the answer says the object has 123 bytes, \d+ when it was opened"
    ):
        dict(stream)


@pytest.mark.parametrize("length", ["²³", "12a", "-5", "1" * 21])
def test_a_content_length_of_other_than_ascii_digits_is_refused(checkpoint, length, no_leaks):
    server, _ = checkpoint
    server.misbehave.content_length = length
    with pytest.raises(weightstream.SourceError, match=r"the server gave no Content-Length of decimal digits"):
        weightstream.load_weights(f"{server.url}/model-00001-of-00002.safetensors")


def test_a_trickling_server_counts_as_stalled(checkpoint, no_leaks):
    server, _ = checkpoint
    server.misbehave.trickle_seconds_per_byte = 0.01  # 100 bytes/s: every byte within any per-byte timeout
    start = time.monotonic()
    with pytest.raises(weightstream.SourceTimeout, match=r"bytes in \d+\.\d s, below 65536 bytes/s \(stalled\)"):
        weightstream.load_weights(f"{server.url}/model-00001-of-00002.safetensors", request_timeout_s=1, retries=0)
    assert time.monotonic() - start < 10


def test_the_deadline_holds_inside_a_read_that_keeps_receiving(checkpoint, no_leaks):
    server, _ = checkpoint
    server.misbehave.trickle_seconds_per_byte = 0.002
    start = time.monotonic()
    with pytest.raises(weightstream.SourceTimeout, match=r"the load's deadline passed"):
        weightstream.load_weights(
            f"{server.url}/model-00001-of-00002.safetensors", request_timeout_s=60, deadline_s=1.5
        )
    assert time.monotonic() - start < 6


@pytest.mark.parametrize("loader", ["safetensors", "streaming", "layered"])
def test_a_claimed_petabyte_is_refused_before_any_request_is_built(tmp_path: Path, loader, no_leaks):
    header = {"model.layers.0.w": {"dtype": "U8", "shape": [2**50], "data_offsets": [0, 2**50]}}
    raw = raw_file(tmp_path / "huge.safetensors", header)
    server_root = raw.parent
    with RangeServer(server_root) as server:
        server.misbehave.virtual_size = raw.stat().st_size + 2**50
        before = psutil.Process().memory_info().rss
        start = time.monotonic()
        with pytest.raises(
            weightstream.HostMemoryError,
            match=r"huge.safetensors( \(1 buffer\(s\) of its largest layer\))?: needs 11258999068\d{5} bytes of memory "
            r"at once, more than this machine has",
        ):
            weightstream.load_weights(f"{server.url}/huge.safetensors", format=loader)
        assert time.monotonic() - start < 5
        assert psutil.Process().memory_info().rss - before < 64 << 20


def test_percent_encoded_shard_names_cannot_leave_the_checkpoint(tmp_path: Path, no_leaks):
    root = tmp_path / "root"
    root.mkdir()
    index = {"metadata": {}, "weight_map": {"w": "%2e%2e/secret.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with (
        RangeServer(root) as server,
        pytest.raises(
            weightstream.ShardIndexError,
            match=r"shard name '%2e%2e/secret.safetensors' is not a plain relative path "
            r"inside the checkpoint directory",
        ),
    ):
        weightstream.load_weights(server.url)


def test_unknown_schemes_are_unsupported_not_missing(no_leaks):
    for uri in ("ftp://host/model.safetensors", "hdfs://cluster/model/"):
        with pytest.raises(
            weightstream.UnsupportedInputError,
            match=r"://.* URIs are not supported; use s3://, gs://, az://, oci://, http\(s\)://",
        ):
            weightstream.load_weights(uri)


def test_a_replaced_file_is_never_served_by_a_server_that_honours_if_match(checkpoint, no_leaks):
    server, _ = checkpoint
    shard = server.root / "model-00002-of-00002.safetensors"
    replaced = threading.Event()
    other = save_hf_sharded(llama_state_dict(SHAPE, seed=3), server.root.parent / "v3", shards=2)

    def replace_after_first_read(nbytes: int) -> None:
        if not replaced.is_set():
            replaced.set()
            replace_file(shard, (other / shard.name).read_bytes())

    with pytest.raises(
        weightstream.SourceChangedError, match=r"HTTP 412: the object no longer matches the version planned"
    ):
        weightstream.load_weights(server.url, chunk_bytes=64 << 10, threads=1, progress=replace_after_first_read)


def test_credentials_never_follow_a_redirect_to_another_host(tmp_path: Path, no_leaks):
    """A Hub answering 302 to a CDN (two loopback hosts): the token reaches the Hub, never the CDN."""
    state = llama_state_dict(SHAPE, seed=4)
    root = save_hf_sharded(state, tmp_path / "root", shards=2)
    with RangeServer(root, host="127.0.0.2") as cdn, RangeServer(root) as hub:
        hub.misbehave.redirect_to = cdn.url
        loaded = weightstream.load_weights(
            hub.url, storage_options={"headers": {"Authorization": "Bearer hub-secret", "X-Trace": "1"}}
        )
        assert_same(loaded, state)
        assert hub.authorizations and set(hub.authorizations) == {"Bearer hub-secret"}
        assert cdn.authorizations and set(cdn.authorizations) == {None}, "the token went to the CDN"
        assert any(line.startswith("GET ") for line in cdn.requests), "the tensor bytes came from the CDN"


@pytest.mark.parametrize(
    ("location", "kept"),
    [
        ("https://hub.example/other/path", True),
        ("https://hub.example:443/x", True),
        ("https://HUB.example/x", True),
        ("https://cdn.example/x", False),
        ("https://hub.example:8443/x", False),
        ("http://hub.example/x", False),
    ],
)
def test_which_redirects_keep_the_credentials(location, kept):
    from weightstream.sources.http.store import HttpStore

    store = HttpStore(
        {"headers": {"Authorization": "Bearer t", "Cookie": "c", "Proxy-Authorization": "p", "Accept": "*/*"}}
    )
    try:
        headers = store.headers_for("https://hub.example/m.safetensors", location)
        assert headers == (
            {"Authorization": "Bearer t", "Cookie": "c", "Proxy-Authorization": "p", "Accept": "*/*"}
            if kept
            else {"Accept": "*/*"}
        )
        assert "Authorization" in store.headers_for(
            "http://hub.example/m.safetensors", "https://hub.example/m.safetensors"
        )  # an upgrade
    finally:
        store.close()
