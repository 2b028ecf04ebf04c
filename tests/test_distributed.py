"""The distributed loader across real processes (gloo over loopback): bit-exact results on every
rank, storage bytes read once in all, uneven and extreme tensor sizes, filters, and failures of
one rank (killed, stopping early, a read error, another plan) raising on the others, promptly;
and the same from the object stores (real servers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import weightstream
from tests.conftest import save_hf_sharded
from weightstream.bench.demo import LlamaShape, llama_state_dict

ROOT = Path(__file__).parent.parent
SHAPE = LlamaShape(hidden=256, intermediate=704, layers=3, vocab=1001)  # an odd vocabulary: sizes do not divide evenly


def run_ranks(
    tmp_path: Path, world: int, uri: str, mode: str = "load", victim: int = -1, environment: dict | None = None
) -> list[dict]:
    init = f"file://{tmp_path / 'rendezvous'}"
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.distributed_rank", init, str(rank), str(world), uri, mode, str(victim)],
            cwd=ROOT,
            env={**os.environ, **(environment or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    results = []
    for rank, process in enumerate(processes):
        output, errors = process.communicate(timeout=120)
        if rank == victim and mode == "kill":
            assert process.returncode == -9
            continue
        assert process.returncode == 0, errors[-3000:]
        results.append(json.loads(output.strip().splitlines()[-1]))
    return results


def checkpoint(tmp_path: Path, state: dict[str, torch.Tensor] | None = None) -> tuple[str, int]:
    state = state if state is not None else llama_state_dict(SHAPE)
    return str(save_hf_sharded(state, tmp_path / "ckpt", shards=2)), sum(
        t.numel() * t.element_size() for t in state.values()
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cache", "cache-some"])
def test_ranks_on_one_node_attach_its_cache_instead_of_sharing_reads(tmp_path: Path, mode):
    from tests.cache_daemon import running_daemon, stats

    uri, _ = checkpoint(tmp_path)
    with running_daemon("dist") as daemon:
        results = run_ranks(tmp_path, 3, uri, mode, environment={"WEIGHTSTREAM_TEST_CACHE": str(daemon.socket)})
        filled = stats(daemon.socket)
    assert all(r.get("bit_exact") for r in results), results
    assert filled["fills"] == len(list(Path(uri).iterdir())), filled  # the index and each shard, once for all ranks
    shared = sum(r["stats"]["sent_bytes"] + r["stats"]["received_bytes"] for r in results)
    if mode == "cache":
        assert shared == 0 and all(r["stats"]["read_bytes"] == 0 for r in results), "every rank maps: nothing shared"
    else:
        assert shared > 0, "some ranks have no cache: the load is shared as without one"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_every_tensor_bit_exact_and_storage_is_read_once(tmp_path: Path, world):
    uri, total = checkpoint(tmp_path)
    results = run_ranks(tmp_path, world, uri)
    assert all(r.get("bit_exact") for r in results), results
    assert sum(r["stats"]["read_bytes"] for r in results) == total, "the ranks together read the checkpoint once"
    shares = [r["stats"]["read_bytes"] for r in results]
    assert max(shares) - min(shares) <= 256 << 10, f"unbalanced shares {shares}"
    assert all(r["stats"]["read_bytes"] + r["stats"]["received_bytes"] == total for r in results)


@pytest.mark.slow
def test_through_a_staging_ring_as_to_a_gpu(tmp_path: Path):
    uri, total = checkpoint(tmp_path)
    results = run_ranks(tmp_path, 3, uri, "staged")
    assert all(r.get("bit_exact") for r in results), results
    assert sum(r["stats"]["read_bytes"] for r in results) == total
    for result in results:
        assert result["violations"] == [], "a slot was written while its copy was pending"
        assert result["copies"] * (64 << 10) >= result["stats"]["read_bytes"] > 0, (
            "every byte read went through the ring's 64 KiB slots"
        )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (and NCCL)")
@pytest.mark.parametrize("world", [1, 2])
def test_to_gpus_over_nccl(tmp_path: Path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"NCCL needs a GPU per rank: {world} ranks, {torch.cuda.device_count()} GPU(s)")
    uri, total = checkpoint(tmp_path)
    results = run_ranks(tmp_path, world, uri, "cuda")
    assert all(r.get("bit_exact") for r in results), results
    assert sum(r["stats"]["read_bytes"] for r in results) == total


@pytest.mark.slow
@pytest.mark.parametrize("remote", ["s3", "gs", "http", "az", "oci"])
def test_a_remote_checkpoint_is_read_once_and_shared(remote, request, tmp_path: Path):
    from tests.test_objectstore import upload
    from weightstream.save.push import push

    local, total = checkpoint(tmp_path)
    key = f"distributed-{tmp_path.name}"
    fixtures = {"s3": "s3_endpoint", "gs": "gcs_endpoint", "http": "http_base", "az": "azure_endpoint"}
    fixtures["oci"] = "oci_address"
    server = request.getfixturevalue(fixtures[remote])
    if remote == "oci":
        uri = f"oci://{server}/distributed/{key.lower().replace('_', '-')}:v1"
        push(local, uri)
    else:
        uri = upload("s3" if remote == "http" else remote, Path(local), key)
    if remote == "http":
        uri = f"{request.getfixturevalue('http_base')}/{key}"
    results = run_ranks(tmp_path, 2, uri)
    assert all(r.get("bit_exact") for r in results), results
    assert sum(r["stats"]["read_bytes"] for r in results) == total
    assert all(r["stats"]["read_bytes"] + r["stats"]["received_bytes"] == total for r in results)


@pytest.mark.slow
def test_tiny_tensors_one_huge_tensor_and_a_filter(tmp_path: Path):
    state = {f"model.layers.0.tiny.{n}": torch.tensor([n], dtype=torch.int8) for n in range(40)}
    state["model.layers.1.huge"] = torch.randn(3_000_001)  # one tensor of many chunks
    state["model.layers.1.empty"] = torch.empty(0, 4)
    uri, total = checkpoint(tmp_path, state)
    results = run_ranks(tmp_path, 3, uri)
    assert all(r.get("bit_exact") for r in results), results
    assert sum(r["stats"]["read_bytes"] for r in results) == total
    filtered = run_ranks(tmp_path, 2, uri, "filter")
    assert all(r.get("bit_exact") and r["tensors"] == 2 for r in filtered), filtered
    assert sum(r["stats"]["read_bytes"] for r in filtered) == 3_000_001 * 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("kill", r"lost a peer while loading .* \(chunk \d+ of \d+\): "),
        ("abandon", r"another rank stopped while loading .* its own error says why"),
        ("fail", r"another rank stopped while loading"),
        ("other-filter", r"the ranks planned different loads"),
        ("plan-fail", r"another rank failed while planning .*; its own error says why"),
        ("sizing-fail", r"another rank failed while setting up the load of .*; its own error says why"),
        ("memory-fail", r"another rank stopped while loading .* \(before chunk 0 of \d+\); its own error says why"),
    ],
)
def test_one_rank_failing_makes_the_others_raise_promptly(tmp_path: Path, mode, message):
    import re

    uri, _ = checkpoint(tmp_path)
    results = run_ranks(tmp_path, 3, uri, mode, victim=1)
    others = [r for r in results if r["rank"] != 1]
    assert len(others) == 2
    for result in others:
        assert result.get("error") and result["error"][0] == "PeerError" and re.search(message, result["error"][1]), (
            result
        )
        assert result["seconds"] < 30, "a peer's failure must not wait for the group's 60 s timeout"
    own = {
        "fail": ("OSError", r"injected read failure$"),
        "plan-fail": ("NotFound", r"-not-on-this-rank: no such file or directory"),
        "sizing-fail": ("HostMemoryError", r"^injected sizing-fail$"),
        "memory-fail": ("HostMemoryError", r"^injected memory-fail$"),
    }
    if mode in own:
        (victim,) = [r for r in results if r["rank"] == 1]
        assert victim["error"][0] == own[mode][0] and re.search(own[mode][1], victim["error"][1]), victim


def test_the_loader_needs_torch_distributed(tmp_path: Path, no_leaks):
    uri, _ = checkpoint(tmp_path)
    with pytest.raises(weightstream.InvalidOptionError, match=r"needs torch.distributed initialised"):
        weightstream.iter_weights(uri, format="distributed")
    with pytest.raises(
        weightstream.InvalidOptionError,
        match=r"device 'meta': weightstream lands tensors on cpu or cuda devices only; nothing falls back to the CPU",
    ):
        weightstream.iter_weights(uri, format="distributed", device="meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_cuda_destination_without_cuda_is_refused(tmp_path: Path, no_leaks):
    uri, _ = checkpoint(tmp_path)
    with pytest.raises(
        weightstream.DeviceUnavailableError, match=r"device 'cuda' requested, but torch .* sees no CUDA device"
    ):
        weightstream.iter_weights(uri, format="distributed", device="cuda")


def test_the_plan_digest_tells_object_versions_apart_but_not_local_copies():
    from weightstream.planning.plan import FileSpec, LoadPlan
    from weightstream.readers.distributed import plan_digest

    def plan(uri: str, version: str) -> LoadPlan:
        return LoadPlan(uri, (FileSpec(f"{uri}/model-00001-of-00001.safetensors", 4096, 128, {}, version),), ())

    assert plan_digest(plan("s3://bucket/llama", '"etag-a"'), []) != plan_digest(
        plan("s3://bucket/llama", '"etag-b"'), []
    )
    assert plan_digest(plan("gs://bucket/llama", "17"), []) != plan_digest(plan("gs://bucket/llama", "18"), [])
    # Two nodes' copies of one local checkpoint: other inodes and mtimes, the same plan.
    assert plan_digest(plan("/models/llama", "2049:131:1700000000000000000"), []) == plan_digest(
        plan("/models/llama", "2050:977:1700000005000000000"), []
    )
