"""http(s):// checkpoints, served by a real server (SeaweedFS's filer: ranges, ETags, If-Match)."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest

import weightstream
from tests.conftest import assert_same, save_hf_sharded
from tests.test_objectstore import upload
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.sources.http.store import HttpStore

pytestmark = pytest.mark.slow

SHAPE = LlamaShape(hidden=256, intermediate=704, layers=2, vocab=1000)


def served(http_base: str, tmp_path: Path, key: str, seed: int = 1, shards: int = 2) -> tuple[str, dict]:
    """Upload a checkpoint through S3 and return its HTTP URL (a directory with an index) and tensors."""
    state = llama_state_dict(SHAPE, seed=seed)
    upload("s3", save_hf_sharded(state, tmp_path / f"ckpt-{seed}", shards=shards), key)
    return f"{http_base}/{key}", state


def test_directory_with_an_index_streams_bit_exact(http_base, tmp_path: Path, no_leaks):
    url, state = served(http_base, tmp_path, "http-dir")
    assert weightstream.resolve_format(url) == "streaming"
    assert_same(weightstream.load_weights(url, chunk_bytes=64 << 10, threads=3), state)
    assert_same(weightstream.load_weights(url + "/", format="safetensors"), state)


def test_one_file(http_base, tmp_path: Path, no_leaks):
    url, _ = served(http_base, tmp_path, "http-file", shards=1)
    loaded = weightstream.load_weights(url + "/model-00001-of-00001.safetensors")
    assert len(loaded) == len(dict(SHAPE.tensor_shapes()))


def test_file_replaced_mid_load_is_a_typed_error(http_base, tmp_path: Path, no_leaks):
    url, _ = served(http_base, tmp_path, "http-replaced")
    other = save_hf_sharded(llama_state_dict(SHAPE, seed=2), tmp_path / "v2", shards=2)
    replaced = threading.Event()

    def replace_after_first_read(nbytes: int) -> None:
        if not replaced.is_set():
            replaced.set()
            upload("s3", other, "http-replaced")

    with pytest.raises(
        weightstream.SourceChangedError,
        match=r"range \d+\.\.\d+: HTTP 412: the object no longer matches the version planned "
        r"\(replaced while loading\)",
    ):
        weightstream.load_weights(url, chunk_bytes=64 << 10, threads=1, progress=replace_after_first_read)


def test_a_directory_without_an_index_cannot_be_listed(http_base, tmp_path: Path, no_leaks):
    with pytest.raises(
        weightstream.NotFound,
        match=r"no model.safetensors.index.json at this URL, and this store has no directory listing",
    ):
        weightstream.load_weights(f"{http_base}/no-such-directory")
    with pytest.raises(weightstream.NotFound, match=r"no-such-file.safetensors: no such file or directory"):
        weightstream.load_weights(f"{http_base}/no-such-file.safetensors")


def test_only_headers_are_storage_options(http_base, no_leaks):
    with pytest.raises(
        weightstream.InvalidOptionError, match=r"storage_options for http\(s\):// take only 'headers', got endpoint_url"
    ):
        weightstream.load_weights(f"{http_base}/x.safetensors", storage_options={"endpoint_url": "http://elsewhere"})


def test_store_pins_to_the_etag(http_base, tmp_path: Path, no_leaks):
    url, _ = served(http_base, tmp_path, "http-etag", shards=1)
    with contextlib.closing(HttpStore()) as store:
        source = store.open(url + "/model-00001-of-00001.safetensors")
        target = store.range_target(source)
    assert (
        target.url == source.uri and target.headers == {"If-Match": source.version} and source.version.startswith('"')
    )
    assert (target.version_header, target.version) == ("ETag", source.version)
