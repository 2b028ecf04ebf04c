"""The fleet's GPU tier on a GPU (``benchmarks/gpu_check.sh``'s ``fleet-gpu`` step): two daemons keeping copies on
cuda:0 in one fleet. The first fills from the origin and offers its device copy; the second, asked for its copy on
the GPU (``cache prefetch --device``), reads the first's device copy GPU to GPU through NIXL (VRAM registered on both
sides), every piece checked on the way to its host segment: nothing from the origin, every byte from a peer's GPU,
and a load mapping the copy gets the checkpoint's tensors. Without NIXL or a GPU it skips (tests/test_fleet_devices.py
runs the same path with host memory standing for the GPUs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl_cu12", reason="the fleet's data plane needs NIXL (pip install 'weightstream[fleet]')")

import weightstream
from tests.cache_daemon import stats
from tests.conftest import assert_same
from tests.test_fleet_daemons import fleet_of, origin_file

ROOT = Path(__file__).resolve().parents[1]


def prefetch(socket_path: Path, uri: str) -> None:
    command = [sys.executable, "-m", "weightstream.cli", "cache", "prefetch", uri, "--socket", str(socket_path)]
    ran = subprocess.run(
        [*command, "--device", "cuda:0", "--json"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert ran.returncode == 0, ran.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.cuda
def test_a_second_daemon_fills_its_device_copy_from_the_firsts_gpu(tmp_path: Path):
    state, size = origin_file(tmp_path, 1024, 31)
    with (
        fleet_of(tmp_path, "/gpu") as fleet,
        fleet.daemon("first", "--device", "cuda:0") as first,
        fleet.daemon("second", "--device", "cuda:0") as second,
    ):
        prefetch(first.socket, fleet.file)
        (uuid,) = first.status["devices"]
        assert stats(first.socket)["devices"][uuid]["entries"] == 1
        from_origin = fleet.origin.ranged_bytes()
        prefetch(second.socket, fleet.file)
        counts = stats(second.socket)
        assert counts["devices"][uuid]["entries"] == 1, counts["devices"]
        assert counts["fleet"]["bytes_from_peer_devices"] == counts["fleet"]["bytes_from_peers"] == size, (
            counts["fleet"],
            second.log()[-3000:],
        )
        assert counts["fleet"]["bytes_from_origin"] == 0 and fleet.origin.ranged_bytes() == from_origin
        views = weightstream.load_weights(fleet.file, cache=str(second.socket), device="cuda:0", zero_copy=True)
        assert_same({name: tensor.cpu() for name, tensor in views.items()}, state)
        listed = subprocess.run(
            [sys.executable, "-m", "weightstream.cli", "cache", "fleet", "--fleet", fleet.url, "--json"],
            capture_output=True, text=True, timeout=60, check=True, cwd=ROOT,
        )  # fmt: skip
        nodes = json.loads(listed.stdout)["nodes"]
        assert [len(nodes[name]["devices"]) for name in ("first", "second")] == [1, 1], nodes
        del views
