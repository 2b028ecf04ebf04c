"""``weightstream.NodeCache``: the cache daemon's controls from Python, against a real daemon process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weightstream
from tests.cache_daemon import Daemon, remove
from tests.cache_daemon import places as cache_places
from tests.conftest import save_hf_sharded
from weightstream.errors import CacheError, CacheUnavailableError, NotFound


@pytest.fixture
def daemon():
    directory, sock = cache_places("api")
    with Daemon(directory, sock) as running:
        yield running
    remove(directory, sock)


def test_prefetch_ls_stats_evict_stop(tmp_path: Path, daemon, tiny_state, no_leaks):
    checkpoint = save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2)
    cache = weightstream.NodeCache(daemon.socket)
    assert cache.ls() == [] and cache.stats()["entries"] == 0
    seen: list[tuple[int, int]] = []
    result = cache.prefetch(checkpoint, progress=lambda nbytes, total: seen.append((nbytes, total)))
    files = sorted(checkpoint.glob("*.safetensors"))
    total = sum(path.stat().st_size for path in files)
    assert (result["files"], result["bytes"], result["device"]) == (2, total, None)
    assert [total_seen for _, total_seen in seen] == [total, total] and sum(n for n, _ in seen) == total
    listed = cache.ls()
    assert set(result["keys"]) <= {entry["key"] for entry in listed}
    cached_names = sorted([*(path.name for path in files), "model.safetensors.index.json"])
    assert sorted(entry["uri"] for entry in listed) == [str(checkpoint / name) for name in cached_names]
    assert cache.stats()["fills"] == 3
    loaded = weightstream.load_weights(checkpoint, cache=str(daemon.socket))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tiny_state.items())
    assert cache.stats()["fills"] == 3, "the load read the source again after the prefetch"
    del loaded
    first_key = result["keys"][0]
    assert cache.evict(first_key)["evicted"] == [first_key]
    assert len(cache.evict(checkpoint)["evicted"]) == 2  # by URI: the directory holding them
    assert cache.ls() == []
    with pytest.raises(CacheError, match="evict: name a key or a URI, or pass all=True"):
        cache.evict()
    with pytest.raises(CacheError, match="evict: name a key or a URI, or pass all=True"):
        cache.evict(first_key, all=True)
    assert cache.stop(wait=True)["stopped"] is True
    assert not os.path.exists(daemon.socket) and daemon.process.wait(timeout=30) == 0


def test_prefetch_of_what_is_not_there_fills_nothing(tmp_path: Path, daemon, no_leaks):
    cache = weightstream.NodeCache(str(daemon.socket))
    save_file({"w": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(NotFound):
        cache.prefetch(tmp_path / "missing")
    assert cache.ls() == [] and cache.stats()["fills"] == 0


def test_no_daemon_is_a_typed_error(tmp_path: Path, no_leaks):
    cache = weightstream.NodeCache(tmp_path / "nobody.sock")
    assert repr(cache) == f"NodeCache({str(tmp_path / 'nobody.sock')!r})"
    with pytest.raises(CacheUnavailableError, match="no weightstream cache daemon at .*nobody.sock: no such socket"):
        cache.stats()


def test_auto_is_the_environment_then_the_default(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("WEIGHTSTREAM_CACHE", str(tmp_path / "env.sock"))
    assert weightstream.NodeCache().socket == str(tmp_path / "env.sock")
