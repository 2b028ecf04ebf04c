"""Every registered loader refuses malformed input with the specific typed error, leaking nothing."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

import weightstream
from tests.conformance.conftest import CASES
from tests.conformance.writers import running
from tests.conftest import assert_same
from weightstream.errors import HeaderError, NotFound, ShardIndexError, TruncatedFileError, UnsupportedInputError


def header_bytes(document: object) -> bytes:
    raw = json.dumps(document).encode()
    return struct.pack("<Q", len(raw)) + raw


def f32(offsets=(0, 8), shape=(2,), dtype="F32"):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


VALID = header_bytes({"a": f32()}) + b"\x00" * 8
MALFORMED = {
    "under-8-bytes": (b"\x01\x02\x03", HeaderError, r"file is 3 bytes, shorter than the 8-byte header length"),
    "length-past-eof": (
        struct.pack("<Q", 1000) + b"{}",
        HeaderError,
        r"header length 1000 runs past the end of the file",
    ),
    "length-over-limit": (
        struct.pack("<Q", 100_000_001) + b"{}",
        HeaderError,
        r"header length 100000001 exceeds the limit",
    ),
    "length-2**64-1": (
        struct.pack("<Q", 2**64 - 1) + b"{}",
        HeaderError,
        r"header length 18446744073709551615 exceeds the limit",
    ),
    "non-utf8": (struct.pack("<Q", 3) + b'{"\xff', HeaderError, r"header is not valid UTF-8"),
    "not-json": (struct.pack("<Q", 5) + b"{oops", HeaderError, r"header is not valid JSON"),
    "json-array": (struct.pack("<Q", 2) + b"[]", HeaderError, r"header is a JSON array, expected a JSON object"),
    "nul-padding": (
        struct.pack("<Q", 6) + b"{}\x00\x00\x00\x00",
        HeaderError,
        r"header contains a NUL byte at file offset 10",
    ),
    "duplicate-key": (struct.pack("<Q", 16) + b'{"a": 1, "a": 2}', HeaderError, r"header has the key 'a' twice"),
    "metadata-not-string": (header_bytes({"__metadata__": {"k": 1}}), HeaderError, r"__metadata__\['k'\] is int 1"),
    "unknown-dtype": (
        header_bytes({"a": f32(dtype="Q8")}) + bytes(8),
        HeaderError,
        r"tensor 'a' in .*: unknown dtype 'Q8'",
    ),
    "negative-shape": (
        header_bytes({"a": f32(shape=(-2,))}) + bytes(8),
        HeaderError,
        r"shape \[-2\] is not a list of non-negative integers",
    ),
    "non-integer-shape": (
        header_bytes({"a": f32(shape=(2.5,))}) + bytes(8),
        HeaderError,
        r"shape \[2.5\] is not a list",
    ),
    "shape-overflow": (
        header_bytes({"a": f32(shape=(2**33, 2**33))}) + bytes(8),
        HeaderError,
        r"more than fit in 64 bits",
    ),
    "byte-count-mismatch": (
        header_bytes({"a": f32(offsets=(0, 4))}) + bytes(4),
        HeaderError,
        r"hold 4 bytes, expected 8 for F32 \[2\]",
    ),
    "overlap": (
        header_bytes({"a": f32(), "b": f32(offsets=(4, 12))}) + bytes(12),
        HeaderError,
        r"tensor 'b' .* overlap the previous tensor 'a'",
    ),
    "gap": (
        header_bytes({"a": f32(), "b": f32(offsets=(9, 17))}) + bytes(17),
        HeaderError,
        r"tensor 'b' .* leave a gap of 1 bytes after tensor 'a'",
    ),
    "begin-after-end": (
        header_bytes({"a": f32(offsets=(8, 0))}) + bytes(8),
        HeaderError,
        r"data_offsets \[8, 0\] begin after they end",
    ),
    "trailing-bytes": (VALID + b"xyz", HeaderError, r"3 trailing bytes after the last tensor"),
    "truncated-body": (
        VALID[:-3],
        TruncatedFileError,
        r"tensor 'a' in .*: data_offsets \[0, 8\] .* end past the end of the file",
    ),
}


@pytest.fixture(params=CASES, ids=[f"{name}-{writer.__name__}" for name, writer in CASES])
def checkpoint(request, tmp_path: Path, tiny_state):
    """A valid checkpoint of the loader's layout, and the first safetensors file in it."""
    name, writer = request.param
    uri = writer(tiny_state, tmp_path / "ckpt")
    first = min(Path(uri).glob("*.safetensors")) if Path(uri).is_dir() else Path(uri)
    with running(name, tmp_path):
        yield name, uri, first


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file(case, checkpoint, no_leaks):
    name, uri, first = checkpoint
    content, error, message = MALFORMED[case]
    first.write_bytes(content)
    with pytest.raises(error, match=message) as raised:
        weightstream.load_weights(uri, format=name)
    assert str(first) in str(raised.value)


@pytest.mark.parametrize("suffix", [".bin", ".pt"])
def test_pickle_file_refused_unread(suffix, tmp_path: Path, no_leaks):
    path = tmp_path / f"pytorch_model{suffix}"
    path.write_bytes(b"\x80\x04\x95 this would run code if unpickled")
    with pytest.raises(
        UnsupportedInputError, match=rf"{suffix} files are pickles \(torch.save\); weightstream never unpickles"
    ):
        weightstream.load_weights(path)
    directory = tmp_path / "only-pickles"
    directory.mkdir()
    os.replace(path, directory / path.name)
    with pytest.raises(UnsupportedInputError, match=r"holds only pickle-based weights \(pytorch_model"):
        weightstream.load_weights(directory)


def test_missing_path(tmp_path: Path):
    with pytest.raises(NotFound, match=r"no-such: no such file or directory"):
        weightstream.load_weights(tmp_path / "no-such")


def test_empty_directory(tmp_path: Path):
    with pytest.raises(NotFound, match=r"no \.safetensors files and no model.safetensors.index.json"):
        weightstream.load_weights(tmp_path)


# -- the Hugging Face index --------------------------------------------------------------------


@pytest.fixture
def sharded(tmp_path: Path, tiny_state):
    from tests.conftest import save_hf_sharded

    directory = save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2)
    index_path = directory / "model.safetensors.index.json"
    return directory, index_path, json.loads(index_path.read_text())


def test_index_names_missing_shard(sharded, no_leaks):
    directory, index_path, index = sharded
    index["weight_map"]["lm_head.weight"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(NotFound, match=r"names shard 'model-00009-of-00009.safetensors', which does not exist"):
        weightstream.load_weights(directory)


def test_index_lists_tensor_twice(sharded, no_leaks):
    directory, index_path, _ = sharded
    text = index_path.read_text().replace('"weight_map": {', '"weight_map": {"lm_head.weight": "x.safetensors", ', 1)
    index_path.write_text(text)
    with pytest.raises(ShardIndexError, match=r"model.safetensors.index.json has the key 'lm_head.weight' twice"):
        weightstream.load_weights(directory)


@pytest.mark.parametrize(
    "shard",
    [
        "../outside.safetensors",
        "/etc/passwd",
        "http://example.com/x.safetensors",
        "a/../../b.safetensors",
        "C:\\x.safetensors",
    ],
)
def test_index_path_outside_directory(sharded, shard, no_leaks):
    directory, index_path, index = sharded
    index["weight_map"]["lm_head.weight"] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(ShardIndexError, match=r"is not a plain relative path inside the checkpoint directory"):
        weightstream.load_weights(directory)


def test_index_and_shards_disagree(sharded, no_leaks):
    directory, index_path, index = sharded
    del index["weight_map"]["lm_head.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ShardIndexError, match=r"holds tensor 'lm_head.weight', which the index does not list"):
        weightstream.load_weights(directory)


def test_index_not_json(sharded, no_leaks):
    directory, index_path, _ = sharded
    index_path.write_text("{")
    with pytest.raises(
        ShardIndexError,
        match=r"model.safetensors.index.json is not valid JSON: Expecting property name enclosed in double quotes at "
        r"byte 1",
    ):
        weightstream.load_weights(directory)


def test_same_tensor_in_two_plain_shards(tmp_path: Path, no_leaks):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(weightstream.FormatError, match=r"tensor 'w' is in both .*a.safetensors and .*b.safetensors"):
        weightstream.load_weights(tmp_path)


# -- the mutation fuzzer ----------------------------------------------------------------------

SEED_FILE = safetensors_save(
    {
        "embed": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "bias": torch.ones(3, dtype=torch.bfloat16),
        "n": torch.tensor(7),
    },
    metadata={"format": "pt"},
)


@st.composite
def mutations(draw):
    blob = bytearray(SEED_FILE)
    kind = draw(st.sampled_from(["flip", "truncate", "splice", "flip-header"]))
    if kind in ("flip", "flip-header"):
        limit = 8 + int.from_bytes(blob[:8], "little") if kind == "flip-header" else len(blob)
        for _ in range(draw(st.integers(1, 4))):
            position = draw(st.integers(0, limit - 1))
            blob[position] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        del blob[draw(st.integers(0, len(blob) - 1)) :]
    else:
        start = draw(st.integers(0, len(blob)))
        end = draw(st.integers(start, len(blob)))
        at = draw(st.integers(0, len(blob)))
        blob[at:at] = blob[start:end]
    return bytes(blob)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=mutations(), direct=st.booleans())
def test_mutated_files_give_typed_errors_or_a_correct_load(blob, direct, tmp_path: Path):
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(blob)
    try:
        loaded = weightstream.load_weights(path, chunk_bytes=4096, direct_io=direct)
    except weightstream.WeightstreamError as error:
        assert isinstance(error, (HeaderError, TruncatedFileError)), repr(error)
        return
    assert_same(loaded, safetensors_load(blob))
