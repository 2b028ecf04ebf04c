"""The streaming loader: a bounded window, completion order, early abandonment, and its memory
envelope measured in a fresh process against a real S3 server."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import weightstream
from tests.conftest import assert_same, save_hf_sharded
from tests.test_objectstore import upload
from weightstream.bench.demo import LlamaShape, llama_state_dict, write_sharded

MIB = 1 << 20
SHAPE = LlamaShape(hidden=512, intermediate=1408, layers=4, vocab=4000)  # about 24 MiB, tensors up to 4 MiB


class ReadAccounting:
    """Bytes read so far (from the progress callback) against bytes the consumer has received."""

    def __init__(self) -> None:
        self.read = 0
        self.lock = threading.Lock()

    def __call__(self, nbytes: int) -> None:
        with self.lock:
            self.read += nbytes


def consume_slowly(stream, accounting: ReadAccounting) -> tuple[dict, int]:
    """Every tensor, and the most bytes ever read but not yet handed over, seen at each yield."""
    loaded, received, ahead = {}, 0, 0
    for name, tensor in stream:
        time.sleep(0.002)  # a slow consumer: readers that ignored the window would run far ahead
        with accounting.lock:
            ahead = max(ahead, accounting.read - received)
        received += tensor.numel() * tensor.element_size()
        loaded[name] = tensor
    return loaded, ahead


@pytest.mark.parametrize("window_mib", [4, 9, 16])
def test_reads_never_run_further_ahead_than_the_window(tmp_path: Path, window_mib, no_leaks):
    state = llama_state_dict(SHAPE, seed=5)
    uri = str(save_hf_sharded(state, tmp_path / "ckpt", shards=2))
    accounting = ReadAccounting()
    stream = weightstream.iter_weights(
        uri, format="streaming", chunk_bytes=MIB, max_inflight_bytes=window_mib * MIB, threads=4, progress=accounting
    )
    loaded, ahead = consume_slowly(stream, accounting)
    assert_same(loaded, state)
    assert ahead <= window_mib * MIB, f"{ahead} bytes read ahead of the consumer, window {window_mib} MiB"
    assert ahead > 0


def test_tensors_come_as_their_bytes_complete_not_after_the_whole_file(tmp_path: Path, no_leaks):
    state = llama_state_dict(SHAPE, seed=6)
    uri = str(save_hf_sharded(state, tmp_path / "ckpt", shards=1))
    accounting = ReadAccounting()
    stream = weightstream.iter_weights(
        uri, format="streaming", chunk_bytes=MIB, max_inflight_bytes=8 * MIB, progress=accounting
    )
    with contextlib.closing(stream):
        next(stream)
        with accounting.lock:
            read_at_first = accounting.read
    assert read_at_first <= 8 * MIB < sum(t.numel() * t.element_size() for t in state.values())


def test_a_window_too_small_for_the_largest_tensor_is_refused_before_reading(tmp_path: Path, no_leaks):
    uri = str(save_hf_sharded(llama_state_dict(SHAPE, seed=7), tmp_path / "ckpt", shards=1))
    with pytest.raises(
        weightstream.InvalidOptionError,
        match=r"max_inflight_bytes=2097152 \(2 MiB\) cannot hold tensor 'lm_head.weight' of "
        r".*model-00001-of-00001.safetensors \(4096000 bytes, 4100096 with page alignment\): the window holds at "
        r"least the largest tensor, so at least 4 MiB here; or leave it unset \(1 GiB, or the largest tensor",
    ):
        weightstream.iter_weights(uri, format="streaming", chunk_bytes=MIB, max_inflight_bytes=2 * MIB)


def test_a_window_smaller_than_the_default_request_is_refused(tmp_path: Path, no_leaks):
    uri = str(save_hf_sharded(llama_state_dict(SHAPE, seed=7), tmp_path / "ckpt", shards=1))
    with pytest.raises(
        weightstream.InvalidOptionError,
        match=r"max_inflight_bytes=4194304 \(4 MiB\) is less than one read request of .*ckpt \(8388608 bytes, 8 MiB",
    ):
        weightstream.iter_weights(uri, format="streaming", max_inflight_bytes=4 * MIB)


def test_the_safetensors_loader_refuses_a_window(tmp_path: Path, tiny_state, no_leaks):
    uri = str(save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=1))
    with pytest.raises(
        weightstream.InvalidOptionError,
        match=r"max_inflight_bytes: an option of format='streaming'; the safetensors loader does not use it",
    ):
        weightstream.iter_weights(uri, format="safetensors", max_inflight_bytes=64 * MIB)


def test_abandoned_stream_stops_its_readers_and_frees_the_window(tmp_path: Path, no_leaks):
    shape = LlamaShape(hidden=1024, intermediate=2816, layers=8, vocab=8000)  # about 200 MiB
    uri = str(save_hf_sharded(llama_state_dict(shape, seed=8), tmp_path / "ckpt", shards=2))
    baseline = psutil.Process().memory_info().rss
    stream = weightstream.iter_weights(uri, format="streaming", chunk_bytes=MIB, max_inflight_bytes=64 * MIB)
    for _ in range(3):
        next(stream)
    stream.close()
    assert psutil.Process().memory_info().rss - baseline < 16 * MIB, (
        "the window of an abandoned stream was not released"
    )


@pytest.mark.slow
def test_object_store_stream_is_bit_exact_in_a_small_window(scheme, tmp_path: Path, no_leaks):
    state = llama_state_dict(SHAPE, seed=9)
    uri = upload(scheme, save_hf_sharded(state, tmp_path / "ckpt", shards=2), "streaming-small-window")
    assert weightstream.resolve_format(uri) == "streaming"
    accounting = ReadAccounting()
    loaded, ahead = consume_slowly(
        weightstream.iter_weights(uri, chunk_bytes=MIB, max_inflight_bytes=6 * MIB, threads=4, progress=accounting),
        accounting,
    )
    assert_same(loaded, state)
    assert 0 < ahead <= 6 * MIB


@pytest.mark.slow
def test_peak_rss_stays_within_the_window_plus_a_tenth(s3_endpoint, tmp_path: Path):
    """The issue's envelope: a consumer that drops each tensor keeps the process within
    max_inflight_bytes + 10% of its baseline (measured in a fresh process, VmHWM reset after planning)."""
    shape = LlamaShape(hidden=1024, intermediate=2816, layers=16, vocab=16000)  # about 400 MiB, tensors up to 32 MiB
    write_sharded(llama_state_dict(shape, seed=10), tmp_path / "ckpt", shards=2)
    uri = upload("s3", tmp_path / "ckpt", "streaming-envelope")
    window = 96 * MIB
    result = subprocess.run(
        [sys.executable, "-m", "tests.streaming_envelope", uri, str(window)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parent.parent,
        env=os.environ.copy(),
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["bytes"] == shape.nbytes()
    assert measured["peak_above_baseline"] <= 1.1 * window, measured
    assert measured["peak_above_baseline"] >= 0.5 * window, (
        f"the window was not used, so the bound proves little: {measured}"
    )


def test_auto_reads_a_local_checkpoint_in_a_window_when_one_is_asked_for(tmp_path: Path, tiny_state, caplog, no_leaks):
    """``format="auto"`` picks ``safetensors`` for a local path, which takes no window: ``max_inflight_bytes`` asks for
    its twin, the streaming loader (the same files), and the log says so."""
    uri = str(save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2))
    with caplog.at_level(logging.INFO, logger="weightstream"), weightstream.open(uri, max_inflight_bytes=64 * MIB) as c:
        assert c.format == "streaming"
        assert_same(c.load(), tiny_state)
    assert "format='auto': max_inflight_bytes asks for the streaming loader, not safetensors" in caplog.text
    with weightstream.open(uri) as plain:
        assert plain.format == "safetensors"
    with pytest.raises(weightstream.InvalidOptionError, match=r"prefetch_layers: an option of format='layered'"):
        weightstream.open(uri, prefetch_layers=2)
