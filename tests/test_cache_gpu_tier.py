"""The node cache's GPU tier. Without a GPU: the pieces CI can run for real (read-only shared mappings, copies
launched straight from a segment through the staging ring's engine, the daemon's refusals, the ``device``
request's validation). With one (``-m cuda``, benchmarks/gpu_check.sh): CUDA loads copying from page-locked
segments, and a daemon with ``--device`` whose copies clients map read-only and keep after it dies."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import weightstream
from tests.cache_daemon import ROOT, running_daemon, stats
from tests.cache_daemon import request as cache_request
from tests.conftest import assert_same, save_hf_sharded
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.errors import CacheError, CacheProtocolError, DeviceUnavailableError
from weightstream.memory.ring import CpuCopyEngine, CpuStaging
from weightstream.nodecache.client import CachedStore
from weightstream.nodecache.connection import CacheClient
from weightstream.nodecache.protocol import check_request
from weightstream.nodecache.shared_mapping import map_read_only
from weightstream.readers.staged import read_staged
from weightstream.sources.local.file import LocalStore

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPE = LlamaShape(hidden=128, intermediate=352, layers=3, vocab=500)


def mapped_ranges(path: str) -> list[tuple[int, int, str]]:
    """This process's mappings of ``path``: (start, end, permissions)."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if path in line:
            addresses, permissions = line.split()[:2]
            start, end = (int(part, 16) for part in addresses.split("-"))
            found.append((start, end, permissions))
    return found


def test_a_read_only_mapping_shares_the_files_pages_and_goes_with_its_last_tensor(tmp_path: Path):
    path = tmp_path / "segment"
    path.write_bytes(bytes(range(256)) * 64)
    with open(path, "rb") as file:
        mapped = map_read_only(file.fileno(), 256 * 64, what=str(path))
    view = mapped[100:200]
    (start, end, permissions), *others = mapped_ranges(str(path))
    assert not others and permissions.startswith("r--s"), "shared and read-only"
    assert start <= mapped.data_ptr() < end
    assert view.tolist() == list(range(100, 200))
    del mapped
    gc.collect()
    assert mapped_ranges(str(path)), "a view still holds the mapping"
    del view
    gc.collect()
    assert mapped_ranges(str(path)) == []


def test_writing_through_a_read_only_mapping_faults(tmp_path: Path):
    path = tmp_path / "segment"
    path.write_bytes(b"\0" * 4096)
    script = textwrap.dedent(
        f"""
        from weightstream.nodecache.shared_mapping import map_read_only
        with open({str(path)!r}, "rb") as file:
            mapped = map_read_only(file.fileno(), 4096)
        mapped.fill_(1)
        """
    )
    ran = subprocess.run([sys.executable, "-c", script], check=False, cwd=ROOT, capture_output=True, timeout=60)
    assert ran.returncode == -11, ran.stderr.decode()[-500:]
    assert path.read_bytes() == b"\0" * 4096


def test_a_mapping_that_fails_says_which_file_and_why(tmp_path: Path):
    with open(tmp_path / "w", "wb") as file, pytest.raises(weightstream.HostMemoryError, match=r"seg-x: cannot map"):
        map_read_only(file.fileno(), 4096, what="seg-x")  # a write-only descriptor cannot be mapped for reading


class RecordingEngine(CpuCopyEngine):
    """The CPU engine, noting the address of every copy's source."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[tuple[int, int]] = []

    def launch(self, source, destination):
        self.sources.append((source.data_ptr(), source.numel()))
        return super().launch(source, destination)


def read_only_copy_sources(store, segment, fd, answer):
    """What a CUDA load's ``SegmentCopies`` gives, minus the page-locking: the segment mapped shared, read-only."""
    return map_read_only(fd, segment.size, what=segment.uri)


def test_copies_read_straight_from_the_segment_with_no_staging_slot(tmp_path: Path, no_leaks):
    state = llama_state_dict(SHAPE, seed=3)
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=2)
    engines: list[RecordingEngine] = []

    def engine() -> RecordingEngine:
        engines.append(RecordingEngine())
        return engines[-1]

    with running_daemon("gpu") as daemon:
        with weightstream.open(uri, cache=str(daemon.socket), chunk_bytes=65536, staging_slot_bytes=65536) as opened:
            plan, opts = opened.plan, opened.options
        store = CachedStore(LocalStore(), CacheClient(str(daemon.socket)), None, read_only_copy_sources)
        try:
            loaded = dict(read_staged(store, plan, opts, CpuStaging(engine)))
            segments = [(start, end) for start, end, perms in mapped_ranges(str(daemon.directory)) if "s" in perms]
        finally:
            store.close()
        assert_same(loaded, state)
        assert len(engines[0].sources) > len(plan.files), "several requests per file"
        for address, nbytes in engines[0].sources:
            assert any(start <= address and address + nbytes <= end for start, end in segments), (
                "every copy reads the shared, read-only segment, none a staging slot"
            )
        counters = stats(daemon.socket)
        assert counters["fills"] == counters["entries"], "the second client's attaches found the entries filled"
    del loaded, store
    gc.collect()


def test_the_device_request_is_checked_field_by_field():
    request = {"op": "device", "uri": "/m/a.safetensors", "size": 8, "version": None, "gpu": "GPU-1"}
    assert check_request({**request, "storage_options": {}}) == "device"
    with pytest.raises(CacheProtocolError, match=r"device request: 'gpu' is missing"):
        check_request({"op": "device", "uri": "/m/a.safetensors"})
    with pytest.raises(CacheProtocolError, match=r"device request: 'gpu' must be str, got int"):
        check_request({**request, "gpu": 0})


def test_a_daemon_without_gpus_refuses_device_requests_and_says_so_in_attach_answers(tmp_path: Path):
    state = llama_state_dict(SHAPE, seed=1)
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=1)
    file = str(Path(uri) / "model-00001-of-00001.safetensors")
    with running_daemon("gpu") as daemon:
        attached = cache_request(daemon.socket, {"op": "attach", "uri": file, "storage_options": {}})
        assert attached["gpus"] == []
        message = {"op": "device", "uri": file, "gpu": "GPU-00000000-0000-0000-0000-000000000000"}
        with pytest.raises(CacheError, match=r"keeps no device copies \(start it with --device cuda:N\)"):
            cache_request(daemon.socket, {**message, "storage_options": {}})
        assert stats(daemon.socket)["devices"] == {}
        assert daemon.process.poll() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_serving_a_gpu_without_one_is_refused_at_start(tmp_path: Path):
    command = [sys.executable, "-m", "weightstream.cli", "cache", "serve", "--dir", str(tmp_path / "segments")]
    command += ["--socket", str(tmp_path / "c.sock"), "--device", "cuda:0"]
    ran = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1
    assert "weightstream: error: --device cuda:0: " in ran.stderr
    assert not (tmp_path / "c.sock").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
@pytest.mark.parametrize("zero_copy", ["auto", True])
def test_a_cuda_load_through_the_cache_without_cuda_is_refused_and_leaves_nothing(tmp_path: Path, zero_copy, no_leaks):
    uri = save_hf_sharded(llama_state_dict(SHAPE, seed=2), tmp_path / "ckpt", shards=1)
    with running_daemon("gpu") as daemon:
        with pytest.raises(DeviceUnavailableError, match=r"device 'cuda:0' requested, but torch .* sees no CUDA"):
            weightstream.load_weights(uri, cache=str(daemon.socket), device="cuda:0", zero_copy=zero_copy)
        assert stats(daemon.socket)["fills"] == 0


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("format", ["safetensors", "streaming", "layered"])
def test_cuda_loads_copy_from_page_locked_segments(tmp_path: Path, format, no_leaks):
    from weightstream.memory import pinning

    state = llama_state_dict(SHAPE, seed=4)
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=2)
    if not pinning.read_only_supported(0):
        pytest.skip("cudaDevAttrHostRegisterReadOnlySupported is 0 on cuda:0: cached loads go through the ring")
    with running_daemon("gpu") as daemon:
        with weightstream.open(uri, format, cache=str(daemon.socket), device="cuda:0") as checkpoint:
            loaded = checkpoint.load()
            routes = checkpoint.stats.copy_routes
        assert routes == {"page-locked": 2}, routes
        assert {tensor.device.type for tensor in loaded.values()} == {"cuda"}
        assert_same({name: tensor.cpu() for name, tensor in loaded.items()}, state)
        assert pinning.registered_bytes()[1] >= sum(f.stat().st_size for f in Path(uri).glob("*.safetensors"))
        del loaded
        gc.collect()
        torch.cuda.synchronize()
        assert pinning.registered_bytes()[0] == 0, "every segment unlocked once its load is done"


@needs_cuda
@pytest.mark.cuda
def test_device_copies_are_mapped_read_only_without_a_copy_and_outlive_the_daemon(tmp_path: Path, no_leaks):
    state = llama_state_dict(SHAPE, seed=5)
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=2)
    with running_daemon("gpu", "--device", "cuda:0") as daemon:
        (uuid,) = daemon.status["devices"]
        views = weightstream.load_weights(uri, cache=str(daemon.socket), device="cuda:0", zero_copy=True)
        assert stats(daemon.socket)["devices"][uuid]["entries"] == 2
        owned = weightstream.load_weights(uri, cache=str(daemon.socket), device="cuda:0")
        assert stats(daemon.socket)["devices"][uuid]["entries"] == 2, "the second load found the copies made"
        assert_same({name: tensor.cpu() for name, tensor in views.items()}, state)
        assert_same({name: tensor.cpu() for name, tensor in owned.items()}, state)
        before = torch.cuda.memory_allocated(0)
        again = weightstream.load_weights(uri, cache=str(daemon.socket), device="cuda:0", zero_copy=True)
        assert torch.cuda.memory_allocated(0) == before, "views take no memory of torch's allocator"
        daemon.kill()
        assert_same({name: tensor.cpu() for name, tensor in again.items()}, state)
    del views, owned, again
    gc.collect()


@needs_cuda
@pytest.mark.cuda
def test_writing_to_a_device_view_fails_and_the_shared_copy_is_untouched(tmp_path: Path):
    state = llama_state_dict(SHAPE, seed=6)
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=1)
    with running_daemon("gpu", "--device", "cuda:0") as daemon:
        script = textwrap.dedent(
            f"""
            import torch, weightstream
            views = weightstream.load_weights({uri!r}, cache={str(daemon.socket)!r}, device="cuda:0", zero_copy=True)
            next(iter(views.values())).fill_(7)
            torch.cuda.synchronize()
            """
        )
        ran = subprocess.run(
            [sys.executable, "-c", script], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert ran.returncode != 0 and "illegal" in ran.stderr.lower(), ran.stderr[-800:]
        views = weightstream.load_weights(uri, cache=str(daemon.socket), device="cuda:0", zero_copy=True)
        assert_same({name: tensor.cpu() for name, tensor in views.items()}, state)
        del views
        gc.collect()


def prefetch(socket_path: Path, uri: str, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "weightstream.cli", "cache", "prefetch", uri, "--socket", str(socket_path)]
    return subprocess.run([*command, "--json", *extra], check=False, cwd=ROOT, capture_output=True, text=True)


def test_prefetching_for_a_gpu_the_daemon_does_not_serve_fills_the_host_tier_and_fails(tmp_path: Path):
    uri = save_hf_sharded(llama_state_dict(SHAPE, seed=7), tmp_path / "ckpt", shards=2)
    with running_daemon("gpu") as daemon:
        ran = prefetch(daemon.socket, uri, "--device", "cuda:0")
        assert ran.returncode == 1
        expected = "keeps no device copies on cuda:0" if torch.cuda.is_available() else "the CUDA driver cannot be"
        assert "weightstream: error: " in ran.stderr and expected in ran.stderr, ran.stderr
        assert stats(daemon.socket)["entries"] == 2


@needs_cuda
@pytest.mark.cuda
def test_prefetch_makes_the_device_copies_before_the_engine_starts(tmp_path: Path):
    uri = save_hf_sharded(llama_state_dict(SHAPE, seed=8), tmp_path / "ckpt", shards=2)
    with running_daemon("gpu", "--device", "cuda:0") as daemon:
        ran = prefetch(daemon.socket, uri, "--device", "cuda:0")
        assert ran.returncode == 0, ran.stderr
        (uuid,) = daemon.status["devices"]
        assert stats(daemon.socket)["devices"][uuid]["entries"] == 2


CLIENT = """
import json, sys
import torch, weightstream
from cuda.bindings import driver
torch.zeros(1, device="cuda")
device = torch.cuda.current_device()
_, before = driver.cuCtxGetCurrent()
weights = weightstream.load_weights(sys.argv[1], cache=sys.argv[2], device="cuda", zero_copy=True)
_, after = driver.cuCtxGetCurrent()
print(json.dumps({
    "sums": {name: int(tensor.view(torch.int16).to(torch.int64).sum()) for name, tensor in weights.items()},
    "same_device": torch.cuda.current_device() == device,
    "same_context": int(before) == int(after),
}))
"""


def client(uri: Path, socket_path: Path, visible: str | None = None) -> subprocess.Popen[str]:
    """A client process loading ``uri`` as views of the daemon's device copies (``CUDA_VISIBLE_DEVICES=visible``)."""
    import os

    environment = {**os.environ} if visible is None else {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(uri), str(socket_path)],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@needs_cuda
@pytest.mark.cuda
def test_two_clients_at_once_and_one_naming_the_gpu_by_uuid_share_one_copy_and_keep_their_device(tmp_path: Path):
    """Two processes importing at once get the same copy, made once; one that names the GPU by UUID in
    ``CUDA_VISIBLE_DEVICES`` (where the daemon numbers it) finds it too: copies are keyed by UUID. A load leaves the
    caller's current device and context as they were."""
    state = llama_state_dict(SHAPE, seed=9)
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=2)
    expected = {name: int(tensor.view(torch.int16).to(torch.int64).sum()) for name, tensor in state.items()}  # exact
    with running_daemon("gpu", "--device", "cuda:0") as daemon:
        (uuid,) = daemon.status["devices"]
        processes = [client(uri, daemon.socket), client(uri, daemon.socket), client(uri, daemon.socket, visible=uuid)]
        results = []
        for process in processes:
            stdout, stderr = process.communicate(timeout=300)
            assert process.returncode == 0, stderr
            results.append(json.loads(stdout.strip().splitlines()[-1]))
        assert stats(daemon.socket)["devices"][uuid]["entries"] == 2, "each file copied once for all three"
    for result in results:
        assert result["sums"] == expected
        assert result["same_device"] and result["same_context"]
