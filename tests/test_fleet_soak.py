"""Two minutes of the fleet soak (``benchmarks/fleet_soak.py``): four daemons with room for two of five checkpoints,
random loads checked bit-exact, a node killed and restarted, a peer frozen, etcd restarted; nothing fails, every
load is bit-exact, and what the daemons hold at the end is bounded: fds and threads within what their peers'
connections take, the fleet's etcd keys within what the held entries write."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="the fleet's data plane needs NIXL (pip install 'weightstream[fleet]')")

from tests import netns

ROOT = Path(__file__).resolve().parents[1]
NODES, CHECKPOINTS, PIECES = 4, 5, 16
KEYS_BOUND = NODES + CHECKPOINTS * (1 + PIECES + NODES * (2 + PIECES))
"""Node keys, and per checkpoint its plan, digests and each node's offers and claims."""


def test_two_minutes_of_the_soak_load_bit_exact_and_leave_the_nodes_flat(tmp_path: Path):
    command = [sys.executable, "benchmarks/fleet_soak.py", "--minutes", "2", "--kill-every-s", "40",
               "--freeze-s", "15", "--size", "16MiB", "--json", str(tmp_path / "soak.json")]  # fmt: skip
    if netns.available() is not None:
        command.append("--loopback")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["loads"] > 0 and report["bit_exact"] == report["loads"], report
    assert report["failures"] == {} and report["mismatched"] == 0, report
    assert any("killed" in event for event in report["events"]), report["events"]
    assert any("etcd restarted" in event for event in report["events"]), report["events"]
    start, end = report["start"], report["end"]
    peers = NODES - 1
    assert all(fds <= first + 8 * peers + 8 for first, fds in zip(start["fds"], end["fds"])), (start, end)
    assert all(threads <= first + 4 for first, threads in zip(start["threads"], end["threads"])), (start, end)
    assert end["etcd_keys"] <= KEYS_BOUND, end
    assert report["slowest_load_s"] < report["one_origin_read_s"] + 120, report
