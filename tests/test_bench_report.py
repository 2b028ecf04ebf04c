"""The benchmark report: ratios, the text table and the JSON, on CPU and on GPU reports
(the GPU columns are built here from recorded runs, so their formatting is tested without a GPU)."""

from __future__ import annotations

import os

import pytest

from weightstream.bench.methods import METHODS, SETTINGS, with_environment
from weightstream.bench.runner import BenchReport, Row, format_table, plot, ratios
from weightstream.errors import InvalidOptionError

GIB = 1 << 30


def run(seconds: float, **extra) -> dict:
    return {
        "seconds": seconds,
        "first_tensor_seconds": 0.05,
        "bytes": 8 * GIB,
        "baseline_rss": 100,
        "peak_rss": 100 + 64 * 2**20,
        **extra,
    }


def gpu_report() -> BenchReport:
    rows = [
        Row(
            "weightstream",
            "warm",
            "cuda",
            [run(0.5, peak_device_bytes=8 * GIB, peak_pinned_bytes=128 << 20) for _ in range(3)],
        ),
        Row(
            "safetensors.load_file",
            "warm",
            "cuda",
            [run(s, peak_device_bytes=8 * GIB, peak_pinned_bytes=0) for s in (2.0, 2.2, 1.8)],
        ),
        Row("limit-h2d-pinned", "warm", "cuda", [run(0.4, peak_device_bytes=8 * GIB, peak_pinned_bytes=256 << 20)]),
        Row("instanttensor", "warm", "cuda", skipped="instanttensor is not installed"),
    ]
    return BenchReport("/ckpt", ["/ckpt/a.safetensors"], 8 * GIB, 3, rows, {"gpu": "H200"}, "cuda")


def test_gpu_table_has_device_and_pinned_columns_and_ratios():
    table = format_table(gpu_report())
    lines = table.splitlines()
    assert "to cuda" in lines[0]
    assert "GPU +" in lines[1] and "pinned" in lines[1]
    ours = next(line for line in lines if line.startswith("warm  weightstream "))
    assert "17.18" in ours and "8.00 GiB" in ours and "128 MiB" in ours
    safetensors = next(line for line in lines if "safetensors.load_file" in line)
    assert safetensors.rstrip().endswith("4.00x")
    assert "instanttensor" in table and "skipped: instanttensor is not installed" in table
    assert ratios(gpu_report())["warm"]["limit-h2d-pinned"] == pytest.approx(0.8)


def test_gpu_json_carries_the_device_peaks(tmp_path):
    summary = gpu_report().to_json()
    assert summary["device"] == "cuda"
    ours = next(r for r in summary["results"] if r["method"] == "weightstream")
    assert ours["peak_device_bytes_median"] == 8 * GIB and ours["peak_pinned_bytes_median"] == 128 << 20
    plot(summary, str(tmp_path / "gpu.png"))
    assert (tmp_path / "gpu.png").read_bytes()[:4] == b"\x89PNG"


def test_cpu_table_has_no_gpu_columns():
    report = BenchReport(
        "/ckpt", ["/ckpt/a.safetensors"], 8 * GIB, 1, [Row("weightstream", "cold", "cpu", [run(4.0)])], {}, "cpu"
    )
    assert "GPU" not in format_table(report) and "peak_device_bytes_median" not in report.to_json()["results"][0]


def test_unknown_device_is_refused():
    from weightstream.bench.runner import check_device

    with pytest.raises(InvalidOptionError, match=r"unknown benchmark device 'tpu'; devices: cpu, cuda"):
        check_device("tpu")


def test_a_failing_peer_is_a_failed_row_and_the_run_goes_on(tmp_path, monkeypatch, tiny_state):
    """run_worker stands in for the worker processes here (their failure is the piece under test)."""
    from tests.conftest import save_hf_sharded
    from weightstream.bench import runner
    from weightstream.errors import BenchmarkError

    checkpoint = save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=1)
    calls = []

    def worker(device, method, uri, files):
        calls.append(method)
        if method == "safetensors.load_file":
            raise BenchmarkError("benchmark of safetensors.load_file failed (exit 1): PermissionError: access denied")
        return run(0.5)

    monkeypatch.setattr(runner, "run_worker", worker)
    report = runner.run_bench(
        str(checkpoint), methods=["weightstream", "safetensors.load_file"], caches=["warm"], rounds=3
    )
    assert (
        calls.count("safetensors.load_file") == 1 and calls.count("weightstream") == 3
    )  # a failed peer is not run again
    summary = {row["method"]: row for row in report.to_json()["results"]}
    assert summary["safetensors.load_file"] == {
        "method": "safetensors.load_file",
        "cache": "warm",
        "failed": "benchmark of safetensors.load_file failed (exit 1): PermissionError: access denied",
    }
    assert summary["weightstream"]["runs"] == 3
    assert report.to_json()["failed"] == {"safetensors.load_file (warm)": summary["safetensors.load_file"]["failed"]}
    assert (
        "warm  safetensors.load_file    FAILED: benchmark of safetensors.load_file failed (exit 1): PermissionError"
        in format_table(report)
    )
    assert report.weightstream_failed() == []
    plot(report.to_json(), str(tmp_path / "bench.png"))


def test_the_cli_exits_non_zero_only_when_weightstream_failed(tmp_path, monkeypatch, tiny_state, capsys):
    from tests.conftest import save_hf_sharded
    from weightstream import cli
    from weightstream.bench import runner
    from weightstream.errors import BenchmarkError

    checkpoint = save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=1)
    failing = set()

    def worker(device, method, uri, files):
        if method in failing:
            raise BenchmarkError(f"benchmark of {method} failed (exit 1): boom")
        return run(0.5)

    monkeypatch.setattr(runner, "run_worker", worker)
    arguments = [
        "bench",
        str(checkpoint),
        "--methods",
        "weightstream,safetensors.load_file",
        "--page-cache",
        "warm",
        "--rounds",
        "1",
    ]
    failing.add("safetensors.load_file")
    assert cli.main(arguments) == 0
    failing.add("weightstream")
    assert cli.main([*arguments, "--json"]) == 1
    assert (
        "weightstream: error: weightstream (warm) failed: benchmark of weightstream failed (exit 1): boom"
        in capsys.readouterr().err
    )


def test_the_table_says_which_methods_map_instead_of_owning(tmp_path):
    rows = [
        Row("weightstream", "warm", "cpu", [run(2.0)]),
        Row("safetensors.load_file", "warm", "cpu", [run(1.0)]),
    ]
    report = BenchReport("/ckpt", ["/ckpt/a.safetensors"], 8 * GIB, 1, rows, {}, "cpu")
    lines = format_table(report).splitlines()
    assert "memory" in lines[1]
    assert next(line for line in lines if " weightstream " in line).split()[2] == "owned"
    assert next(line for line in lines if "safetensors.load_file" in line).split()[2] == "mapped"
    assert lines[-1].startswith("memory 'mapped': views of the page cache")
    assert [r["memory"] for r in report.to_json()["results"]] == ["owned", "mapped"]
    plot(report.to_json(), str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    only_owned = BenchReport("/ckpt", ["/ckpt/a.safetensors"], 8 * GIB, 1, rows[:1], {}, "cpu")
    assert "mapped" not in format_table(only_owned)


def test_each_peer_and_limit_states_its_settings_beside_its_figure():
    peers = [m for m in METHODS if not m.startswith("weightstream")]
    assert peers and all(SETTINGS.get(m) for m in peers)
    rows = [
        Row("weightstream", "cold", "cpu", [run(2.0)]),
        Row("runai-model-streamer-c4", "cold", "cpu", [run(1.0)]),
        Row("fastsafetensors-buffered", "cold", "cpu", skipped="fastsafetensors is not installed"),
    ]
    report = BenchReport("/ckpt", ["/ckpt/a.safetensors"], 8 * GIB, 1, rows, {}, "cpu")
    lines = format_table(report).splitlines()
    settings = lines[lines.index("settings:") + 1 :]
    assert settings[0].split() == ["weightstream", *SETTINGS["weightstream"].split()]
    assert settings[1].split()[:2] == ["runai-model-streamer-c4", "RUNAI_STREAMER_CONCURRENCY=4"]
    assert not any("fastsafetensors-buffered" in line for line in settings)  # not measured: nothing to state
    results = report.to_json()["results"]
    assert results[1]["settings"] == SETTINGS["runai-model-streamer-c4"] and "settings" not in results[2]


def test_a_peer_reads_the_environment_its_settings_name(monkeypatch):
    seen = []

    def peer(uri, files):
        seen.append(os.environ.get("RUNAI_STREAMER_CONCURRENCY"))
        yield from ()

    monkeypatch.setenv("RUNAI_STREAMER_CONCURRENCY", "16")  # restored after the test, whatever the method set
    list(with_environment(peer, RUNAI_STREAMER_CONCURRENCY="4")("/ckpt", []))
    assert seen == ["4"]


def test_each_round_starts_one_method_later(tmp_path, monkeypatch, tiny_state):
    """No method always runs first after the page cache was prepared (run_worker stands in for the workers)."""
    from tests.conftest import save_hf_sharded
    from weightstream.bench import runner

    checkpoint = save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=1)
    calls = []
    monkeypatch.setattr(runner, "run_worker", lambda device, method, uri, files: calls.append(method) or run(0.5))
    methods = ["weightstream", "safetensors.load_file", "limit-read-reused"]
    runner.run_bench(str(checkpoint), methods=methods, caches=["cold", "warm"], rounds=3)
    assert calls == [
        *methods,
        *methods,
        "safetensors.load_file",
        "limit-read-reused",
        "weightstream",
        "safetensors.load_file",
        "limit-read-reused",
        "weightstream",
        "limit-read-reused",
        "weightstream",
        "safetensors.load_file",
        "limit-read-reused",
        "weightstream",
        "safetensors.load_file",
    ]
