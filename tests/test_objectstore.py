"""s3:// and gs:// against real local servers: bit-exact loads, version pinning, typed errors."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import weightstream
from tests.conformance.test_round_trip import every_dtype
from tests.conftest import assert_same, save_hf_sharded
from tests.objstore import put
from weightstream.bench.demo import LlamaShape, llama_state_dict

pytestmark = pytest.mark.slow


def upload(scheme: str, local: Path, key: str) -> str:
    """Put every file of ``local`` under ``bench/key/``; returns the prefix's URI."""
    for path in sorted(local.iterdir()):
        put(scheme, path, f"{key}/{path.name}")
    return f"{scheme}://bench/{key}"


def test_sharded_checkpoint_every_dtype(scheme, tmp_path: Path, no_leaks):
    state = every_dtype()
    uri = upload(scheme, save_hf_sharded(state, tmp_path / "ckpt", shards=3), "every-dtype")
    assert_same(weightstream.load_weights(uri), state)
    assert_same(weightstream.load_weights(uri + "/", chunk_bytes=4096, threads=3), state)


def test_object_replaced_mid_load_is_a_typed_error_never_a_splice(scheme, tmp_path: Path, no_leaks):
    shape = LlamaShape(hidden=256, intermediate=704, layers=2, vocab=1000)
    uri = upload(
        scheme, save_hf_sharded(llama_state_dict(shape, seed=1), tmp_path / "v1", shards=2), "replaced-mid-load"
    )
    other = save_hf_sharded(llama_state_dict(shape, seed=2), tmp_path / "v2", shards=2)  # same sizes, other bytes
    replaced = threading.Event()

    def replace_after_first_read(nbytes: int) -> None:
        if not replaced.is_set():
            replaced.set()
            upload(scheme, other, "replaced-mid-load")

    with pytest.raises(weightstream.SourceChangedError, match=r"(no longer matches|is gone) .*while loading"):
        weightstream.load_weights(uri, chunk_bytes=64 << 10, threads=1, progress=replace_after_first_read)


def test_object_replaced_between_plan_and_read(scheme, tmp_path: Path, no_leaks):
    shape = LlamaShape(hidden=64, intermediate=160, layers=2, vocab=96)
    uri = upload(
        scheme, save_hf_sharded(llama_state_dict(shape, seed=1), tmp_path / "v1", shards=2), "replaced-before-read"
    )
    stream = weightstream.iter_weights(uri)
    upload(scheme, save_hf_sharded(llama_state_dict(shape, seed=2), tmp_path / "v2", shards=2), "replaced-before-read")
    # Reads are pinned to the planned version: the first range of the replaced object is refused.
    with pytest.raises(
        weightstream.SourceChangedError, match=r"range \d+\.\.\d+: HTTP (412|404)\b.*(no longer matches|is gone)"
    ):
        next(stream)


def test_a_checkpoint_dropped_unread_closes_its_store(scheme, tmp_path: Path, tiny_state, no_leaks):
    """An open checkpoint holds its store for its reads; one nobody reads (or closes) takes it along when collected."""
    uri = upload(scheme, save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2), "dropped-plan")
    checkpoint = weightstream.open(uri)
    assert len(checkpoint.plan.tensors) == len(tiny_state)
    del checkpoint


def test_missing_object_and_prefix(scheme, no_leaks):
    with pytest.raises(weightstream.NotFound, match=rf"{scheme}://bench/no-such-prefix"):
        weightstream.load_weights(f"{scheme}://bench/no-such-prefix")
    with pytest.raises(weightstream.NotFound, match=rf"{scheme}://bench/nothing.safetensors"):
        weightstream.load_weights(f"{scheme}://bench/nothing.safetensors")


@pytest.mark.parametrize(
    "loader, option, message",
    [
        ("safetensors", {"direct_io": True}, "direct_io=True: {uri} is an object, not a local file"),
        ("safetensors", {"zero_copy": True}, "zero_copy=True: {uri} is an object, not a local file"),
        ("auto", {"direct_io": True}, "direct_io=True: {uri} is an object, not a local file"),
        ("auto", {"zero_copy": True}, "zero_copy=True: {uri} is an object, not a local file"),
    ],
)
def test_local_only_options_are_refused_for_objects(
    scheme, tmp_path: Path, tiny_state, loader, option, message, no_leaks
):
    uri = upload(scheme, save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=1), "local-only-options")
    with pytest.raises(weightstream.InvalidOptionError, match=message.format(uri=uri)):
        weightstream.load_weights(uri, format=loader, **option)


def test_endpoint_from_storage_options(s3_endpoint, tmp_path: Path, tiny_state, monkeypatch, no_leaks):
    uri = upload("s3", save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=1), "storage-options")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    loaded = weightstream.load_weights(uri, storage_options={"endpoint_url": s3_endpoint})
    assert_same(loaded, tiny_state)
