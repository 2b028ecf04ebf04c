"""benchmarks/ab.py, small: both sides run, each from its own code, and the report says which is which."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ab(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ab.py"), *arguments, "--dir", str(tmp_path / "checkpoints")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_a_revision_against_the_tree_every_shape_cold_and_warm(tmp_path: Path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    result = ab(tmp_path, "HEAD", "--size", "8MiB", "--rounds", "1", "--json", str(tmp_path / "ab.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "ab.json").read_text())
    assert report["A"]["commit"] == head.stdout.strip() and report["B"]["revision"] == "working tree"
    rows = {(row["shape"], row["cache"]): row for row in report["results"]}
    assert set(rows) == {(shape, cache) for shape in ("llama", "huge", "many") for cache in ("cold", "warm")}
    for row in rows.values():
        for side in ("A", "B"):
            assert row[side]["runs"] == 1 and row[side]["gbps_min"] <= row[side]["gbps_median"] <= row[side]["gbps_max"]
        assert row["b_over_a"] == row["B"]["gbps_median"] / row["A"]["gbps_median"]
    assert "B/A" in result.stdout and result.stderr.count("round ") == 3 * 2 * 2


def test_options_per_side_and_iter_weights_time_the_first_tensor(tmp_path: Path):
    result = ab(
        tmp_path,
        "HEAD",
        "--b",
        "HEAD",
        "--size",
        "8MiB",
        "--rounds",
        "1",
        "--shapes",
        "many",
        "--caches",
        "warm",
        "--call",
        "iter_weights",
        "--b-options",
        '{"threads": 1}',
        "--json",
        str(tmp_path / "ab.json"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "ab.json").read_text())
    assert report["B"]["options"] == {"threads": 1} and report["B"]["revision"] != "working tree"
    (row,) = report["results"]
    assert row["A"]["first_tensor_seconds_median"] is not None


def test_a_revision_that_does_not_exist_is_refused(tmp_path: Path):
    result = ab(tmp_path, "no-such-revision-anywhere", "--size", "16MiB")
    assert result.returncode != 0
    assert "no-such-revision-anywhere" in result.stderr
