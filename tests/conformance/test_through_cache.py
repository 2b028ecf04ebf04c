"""Every registered loader through the node cache (a real daemon, one per module): bit-exact round trips on
every layout it reads, every destination, and a malformed file refused with the same typed error as without
the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

import weightstream
from tests.cache_daemon import running_daemon
from tests.conformance.test_round_trip import every_dtype
from tests.conformance.writers import KEEPING_OPTIONS
from tests.conftest import assert_same


@pytest.fixture(scope="module")
def cache_socket():
    with running_daemon("conformance") as daemon:
        yield str(daemon.socket)


def test_every_dtype_through_the_cache(layout, destination, cache_socket, tmp_path: Path, no_leaks):
    name, writer = layout
    state = every_dtype()
    uri = writer(state, tmp_path / "ckpt")
    loaded = weightstream.load_weights(uri, format=name, cache=cache_socket, **destination.options)
    assert_same(loaded, state, destination)


def test_llama_checkpoint_through_the_cache_in_small_reads(layout, cache_socket, tmp_path: Path, tiny_state, no_leaks):
    name, writer = layout
    uri = writer(tiny_state, tmp_path / "ckpt")
    options = {"chunk_bytes": 4096, "threads": 3, **KEEPING_OPTIONS.get(name, {})}
    assert_same(dict(weightstream.iter_weights(uri, format=name, cache=cache_socket, **options)), tiny_state)


def test_a_malformed_file_is_the_same_typed_error_through_the_cache(layout, cache_socket, tmp_path: Path, tiny_state):
    name, writer = layout
    uri = writer(tiny_state, tmp_path / "ckpt")
    first = min(Path(uri).glob("*.safetensors")) if Path(uri).is_dir() else Path(uri)
    blob = bytearray(first.read_bytes())
    blob[8] = ord("[")  # the header is no JSON object any more
    first.write_bytes(bytes(blob))
    with pytest.raises(weightstream.FormatError) as direct:
        weightstream.load_weights(uri, format=name)
    with pytest.raises(type(direct.value)) as cached:
        weightstream.load_weights(uri, format=name, cache=cache_socket)
    assert str(cached.value) == str(direct.value)
