"""Local files that change, or are not files: pinned like objects, refused in bounded time, never spliced."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

import weightstream
from tests.conftest import assert_same, save_hf_sharded
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.save.write import write_safetensors
from weightstream.sources.local.pagecache import resident_fraction

ROOT = Path(__file__).resolve().parents[1]
SHAPE = LlamaShape(hidden=128, intermediate=352, layers=2, vocab=500)
LOADERS = [("safetensors", {}), ("safetensors", {"zero_copy": True}), ("streaming", {}), ("layered", {})]
LONG_AGO = 1_000_000_000  # mtime in 2001: a write now changes it, whatever the filesystem's timestamp granularity


def checkpoint(directory: Path, seed: int) -> tuple[Path, dict[str, torch.Tensor]]:
    state = llama_state_dict(SHAPE, seed=seed)
    save_hf_sharded(state, directory, shards=2)
    for path in directory.iterdir():
        os.utime(path, (LONG_AGO, LONG_AGO))
    return directory, state


@pytest.mark.parametrize(
    ("loader", "options"), LOADERS, ids=[f"{name}{'-zero-copy' if opts else ''}" for name, opts in LOADERS]
)
def test_a_file_replaced_between_plan_and_read_is_a_changed_source(tmp_path: Path, loader, options, no_leaks):
    directory, _ = checkpoint(tmp_path / "v1", seed=1)
    other, _ = checkpoint(tmp_path / "v2", seed=2)  # the same shapes: the same sizes, other bytes
    stream = weightstream.iter_weights(str(directory), format=loader, **options)  # headers read here
    shard = "model-00001-of-00002.safetensors"
    os.replace(other / shard, directory / shard)
    with pytest.raises(
        weightstream.SourceChangedError,
        match=rf"{shard}: was replaced by another file \(inode \d+ -> \d+\) after its header was read",
    ):
        dict(stream)


@pytest.mark.parametrize(
    ("loader", "options"), LOADERS, ids=[f"{name}{'-zero-copy' if opts else ''}" for name, opts in LOADERS]
)
def test_a_header_rewritten_in_place_is_a_changed_source(tmp_path: Path, loader, options, no_leaks):
    directory, _ = checkpoint(tmp_path / "v1", seed=1)
    shard = directory / "model-00002-of-00002.safetensors"
    stream = weightstream.iter_weights(str(directory), format=loader, **options)
    with open(shard, "r+b") as file:  # same length; the offsets the plan holds now point at other bytes
        file.seek(8)
        header = file.read(64)
        file.seek(8)
        file.write(header.replace(b'"', b"'", 1))
    with pytest.raises(
        weightstream.SourceChangedError,
        match=rf"{shard.name}: was modified \(mtime_ns {LONG_AGO}000000000 -> \d+\) after its header was read",
    ):
        dict(stream)


def test_a_file_rewritten_with_its_mtime_set_back_is_a_changed_source(tmp_path: Path, no_leaks):
    directory, _ = checkpoint(tmp_path / "v1", seed=1)
    shard = directory / "model-00002-of-00002.safetensors"
    stream = weightstream.iter_weights(str(directory))
    before = shard.stat()
    time.sleep(0.05)  # change times are kept at the kernel's tick: a rewrite in the same tick would not show
    with open(shard, "r+b") as file:  # same size, other bytes, and the modification time put back
        file.seek(-4, os.SEEK_END)
        file.write(b"\xff\xff\xff\xff")
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert shard.stat().st_mtime_ns == before.st_mtime_ns
    with pytest.raises(
        weightstream.SourceChangedError,
        match=rf"{shard.name}: was modified \(ctime_ns {before.st_ctime_ns} -> \d+, its mtime unchanged\)",
    ):
        dict(stream)


def test_a_file_written_while_it_is_read_fails_the_load_after_the_reads(tmp_path: Path, no_leaks):
    directory, _ = checkpoint(tmp_path / "v1", seed=1)
    shard = directory / "model-00001-of-00002.safetensors"
    written = threading.Event()

    def write_after_first_read(nbytes: int) -> None:
        if not written.is_set():
            written.set()
            with open(shard, "r+b") as file:
                file.seek(-4, os.SEEK_END)
                file.write(b"\xff\xff\xff\xff")

    with pytest.raises(weightstream.SourceChangedError, match=r"was modified \(mtime_ns \d+ -> \d+\)"):
        weightstream.load_weights(str(directory), chunk_bytes=4096, threads=1, progress=write_after_first_read)


def test_unchanged_files_still_load_bit_exact(tmp_path: Path, no_leaks):
    directory, state = checkpoint(tmp_path / "v1", seed=1)
    for loader, options in LOADERS:
        assert_same(weightstream.load_weights(str(directory), format=loader, **options), state)


@pytest.mark.timeout(30)
def test_a_fifo_is_refused_at_once(tmp_path: Path, no_leaks):
    fifo = tmp_path / "x.safetensors"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(
        weightstream.UnsupportedInputError,
        match=r"x.safetensors: is a FIFO, not a regular file; weightstream reads regular files only",
    ):
        weightstream.load_weights(str(fifo))
    with pytest.raises(weightstream.UnsupportedInputError, match=r"is a FIFO, not a regular file"):
        weightstream.load_weights(str(tmp_path))  # a directory whose one shard is the FIFO
    assert time.monotonic() - start < 5


def test_a_device_is_refused(no_leaks):
    with pytest.raises(
        weightstream.UnsupportedInputError, match=r"/dev/zero: is a character device, not a regular file"
    ):
        weightstream.load_weights("/dev/zero")


def test_symlinks_are_followed_as_in_the_hugging_face_cache(tmp_path: Path, no_leaks):
    blobs, _ = checkpoint(tmp_path / "blobs", seed=1)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for path in blobs.iterdir():
        (snapshot / path.name).symlink_to(path)
    assert_same(weightstream.load_weights(str(snapshot)), weightstream.load_weights(str(blobs)))


def test_a_sparse_two_tib_file_is_probed_in_bounded_memory_and_time(tmp_path: Path, no_leaks):
    sparse = tmp_path / "sparse.safetensors"
    with open(sparse, "wb") as file:
        file.truncate(2 << 40)
    before = psutil.Process().memory_info().rss
    start = time.monotonic()
    assert resident_fraction(str(sparse)) == 0.0
    assert time.monotonic() - start < 5
    assert psutil.Process().memory_info().rss - before < 16 << 20


def test_thousands_of_shards_load_under_the_default_descriptor_limit(tmp_path: Path):
    shards = 1100
    for number in range(shards):
        write_safetensors(
            tmp_path / f"part-{number:05d}.safetensors",
            {f"model.layers.{number}.w": torch.full((4,), number, dtype=torch.int32)},
        )
    script = f"""
import resource, sys, torch, weightstream
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
for loader in ("safetensors", "streaming", "layered"):
    loaded = weightstream.load_weights({str(tmp_path)!r}, format=loader, direct_io="auto")
    assert len(loaded) == {shards}, (loader, len(loaded))
    assert all(int(t[0]) == int(n.split(".")[2]) for n, t in loaded.items()), loader
print("ok")
"""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard >= 1024
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_a_failed_zero_copy_load_holds_no_descriptor_or_mapping(tmp_path: Path, no_leaks):
    directory, _ = checkpoint(tmp_path / "v1", seed=1)
    stream = weightstream.iter_weights(str(directory), zero_copy=True)
    next(stream)  # the first file is mapped
    os.replace(directory / "model-00001-of-00002.safetensors", tmp_path / "moved.safetensors")
    with pytest.raises(
        weightstream.SourceChangedError,
        match=r"model-00001-of-00002.safetensors: was removed or renamed after its header was read",
    ) as caught:
        dict(stream)
    maps = Path("/proc/self/maps").read_text()
    assert (
        str(directory) not in maps and str(tmp_path / "moved.safetensors") not in maps
    )  # while the caller holds the error
    assert caught.value.__traceback__ is not None


def test_a_plan_without_versions_is_checked_for_its_size(tmp_path: Path, no_leaks):
    """Plans made by hand (no versions) still read; a size that changed is still refused."""
    import dataclasses

    from weightstream.planning.planner import read_plan
    from weightstream.readers.destination import Destination, Route
    from weightstream.readers.parallel import read_tensors
    from weightstream.sources.local.file import LocalStore

    host = Destination(Route.HOST, torch.device("cpu"))
    directory, state = checkpoint(tmp_path / "v1", seed=1)
    plan = read_plan(LocalStore(), str(directory), lambda name: True)
    unversioned = dataclasses.replace(plan, files=tuple(dataclasses.replace(spec, version=None) for spec in plan.files))
    assert_same(dict(read_tensors(LocalStore(), unversioned, weightstream.LoadOptions(), host)), state)
    with open(directory / "model-00001-of-00002.safetensors", "ab") as file:
        file.write(b"more")
    with pytest.raises(
        weightstream.SourceChangedError,
        match=r"model-00001-of-00002.safetensors: is \d+ bytes now, \d+ when its header was read",
    ):
        dict(read_tensors(LocalStore(), unversioned, weightstream.LoadOptions(), host))
