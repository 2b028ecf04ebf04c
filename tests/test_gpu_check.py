"""The GPU check's plan fits the device tool's budget, and its dry run (no GPU) runs every step's non-GPU part and
writes the summary, within the 8 files a device call brings back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = [
    "install",
    "stack",
    "paths",
    "ring-tests",
    "cache-tier-tests",
    "fleet-gpu",
    "device-window",
    "cache-gpu-bench",
    "bench-warm",
    "bench-cold",
]


def test_the_plan_lists_each_step_with_its_limit_and_fits_480_s():
    listed = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--list"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    lines = listed.stdout.splitlines()
    assert [line.split()[0] for line in lines] == STEPS
    limits = [int(line.split()[-1]) for line in lines]
    assert all(limit > 10 for limit in limits) and sum(limits) <= 480, limits


@pytest.mark.slow
def test_a_dry_run_runs_every_step_and_summarises(tmp_path: Path):
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "run", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        env={
            **os.environ,
            "OUT": str(out),
            "PYTHON": sys.executable,
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].split()[:3] == ["step", "status", "seconds"]
    statuses = {line.split()[0]: line.split()[1] for line in summary[1 : 1 + len(STEPS)]}
    assert list(statuses) == STEPS
    assert set(statuses.values()) <= {"ok", "skipped"}, summary
    assert statuses["stack"] == "ok" and statuses["cache-tier-tests"] == "ok"
    log = (out / "steps.log").read_text()
    assert all(f"===== {step} " in log for step in STEPS)
    assert len(list(out.iterdir())) <= 8
