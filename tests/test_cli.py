"""The command line, run as a user runs it: a subprocess on real files."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import raw_file, save_hf_sharded
from weightstream.arguments import parse_size


def cli(*args: str, timeout: int = 600, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=environment,
    )


@pytest.fixture
def checkpoint(tmp_path: Path, tiny_state) -> Path:
    return save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2)


def test_inspect_json(checkpoint: Path, tiny_state):
    result = cli("inspect", str(checkpoint), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {t["name"] for t in report["tensors"]} == set(tiny_state)
    embed = next(t for t in report["tensors"] if t["name"] == "model.embed_tokens.weight")
    assert (embed["dtype"], embed["shape"], embed["nbytes"]) == ("BF16", [96, 64], 96 * 64 * 2)
    assert report["total_bytes"] == sum(t.numel() * 2 for t in tiny_state.values())
    assert [f["metadata"] for f in report["files"]] == [{"format": "pt"}, {"format": "pt"}]


def test_inspect_text(checkpoint: Path, tiny_state):
    result = cli("inspect", str(checkpoint))
    assert result.returncode == 0, result.stderr
    assert re.search(
        r"^model\.layers\.2\.mlp\.down_proj\.weight +BF16 +\[64, 160\] +20480$", result.stdout, re.MULTILINE
    )
    assert f"{len(tiny_state)} tensors" in result.stdout


def test_inspect_of_a_tensor_parallel_state_describes_every_rank(checkpoint: Path, tmp_path: Path, tiny_state):
    """A directory ``convert --tp 2`` wrote: without ``--rank``, each rank's files and tensors and the total."""
    converted = cli("convert", str(checkpoint), str(tmp_path / "tp2"), "--to", "sharded-state", "--tp", "2")
    assert converted.returncode == 0, converted.stderr
    text = cli("inspect", str(tmp_path / "tp2"))
    assert text.returncode == 0, text.stderr
    assert re.search(r"^rank 0:$", text.stdout, re.MULTILINE) and re.search(r"^rank 1:$", text.stdout, re.MULTILINE)
    report = json.loads(cli("inspect", str(tmp_path / "tp2"), "--json").stdout)
    assert [rank["rank"] for rank in report["ranks"]] == [0, 1]
    assert report["total_bytes"] == sum(rank["total_bytes"] for rank in report["ranks"])
    assert all({t["name"] for t in rank["tensors"]} == set(tiny_state) for rank in report["ranks"])
    assert re.search(
        rf"^2 ranks, {2 * len(tiny_state)} tensors, {report['total_bytes']} bytes", text.stdout, re.MULTILINE
    )
    one = json.loads(cli("inspect", str(tmp_path / "tp2"), "--rank", "1", "--json").stdout)
    assert "ranks" not in one and one["total_bytes"] == report["ranks"][1]["total_bytes"]


def test_load_json(checkpoint: Path, tiny_state):
    result = cli("load", str(checkpoint), "--json", "--threads", "2")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tensors"] == len(tiny_state)
    assert report["bytes"] == sum(t.numel() * 2 for t in tiny_state.values())
    assert report["gbps"] > 0 and report["format"] == "safetensors"


def test_load_streaming_in_a_window(checkpoint: Path, tiny_state):
    result = cli(
        "load", str(checkpoint), "--json", "--format", "streaming", "--chunk-mib", "1", "--max-inflight-mib", "2"
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["format"], report["tensors"]) == ("streaming", len(tiny_state))


def test_load_layer_by_layer(checkpoint: Path, tiny_state):
    result = cli("load", str(checkpoint), "--json", "--format", "layered", "--prefetch-layers", "2")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["format"], report["tensors"]) == ("layered", len(tiny_state))


def test_load_filter(checkpoint: Path):
    result = cli("load", str(checkpoint), "--json", "--filter", "lm_head.weight", "model.norm.weight")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tensors"] == 2


def test_error_exit_status_and_message(tmp_path: Path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)
    result = cli("load", str(bad))
    assert result.returncode == 1
    assert result.stderr.startswith(f"weightstream: error: {bad}: header length 18446744073709551615 exceeds the limit")
    assert "Traceback" not in result.stderr


def demo_bench(tmp_path: Path, *args: str) -> dict:
    """``weightstream bench`` of a demo checkpoint built in ``tmp_path/cache``, one round, its JSON report."""
    result = cli("bench", "--cache-dir", str(tmp_path / "cache"), "--rounds", "1", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow
def test_bench_builds_the_demo_and_compares(tmp_path: Path):
    report = demo_bench(
        tmp_path,
        *("--size", "24MiB", "--methods", "weightstream,safetensors.load_file,limit-read-reused"),
        *("--plot", str(tmp_path / "bench.png")),
    )
    assert {(r["method"], r["cache"]) for r in report["results"]} == {
        (m, c) for m in ("weightstream", "safetensors.load_file", "limit-read-reused") for c in ("cold", "warm")
    }
    assert all(r["gbps_median"] > 0 and r["runs"] == 1 for r in report["results"])
    assert set(report["ratios"]["cold"]) == {"safetensors.load_file", "limit-read-reused"}
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "cache" / "demo-llama-2l-768h-500v-2s" / "model.safetensors.index.json").exists()
    assert abs(report["total_bytes"] - (24 << 20)) <= (24 << 20) // 4, "--size was not honoured"


@pytest.mark.slow
def test_bench_quick_says_up_front_what_it_runs_and_its_table_says_how_to_read_it(tmp_path: Path):
    methods = "weightstream,limit-read-reused"
    result = cli("bench", "--quick", "--cache-dir", str(tmp_path / "cache"), "--methods", methods)
    assert result.returncode == 0, result.stderr
    said = result.stderr.splitlines()
    assert said[0] == "building (or reusing) a demo Llama checkpoint of about 0.25 GiB ..."
    planned = r"4 runs \(1 round of each installed method, cold, warm\), each a fresh process: about \d+ min"
    assert re.fullmatch(planned, said[1]), said
    assert "ws ratio: weightstream's median GB/s over the method's (above 1: weightstream is faster)" in result.stdout
    assert "cold: the files dropped from the page cache before each run" in result.stdout


@pytest.mark.slow
def test_every_cpu_method_whose_library_is_installed_runs(tmp_path: Path):
    """A peer's new release can change its API (safe_open handles have keys() and no __iter__): every method
    that is not skipped for a missing library must run, peers included."""
    from weightstream.bench.methods import METHODS, SHARDED_STATE_METHODS

    methods = sorted(set(METHODS) - SHARDED_STATE_METHODS)
    report = demo_bench(tmp_path, "--size", "8MiB", "--page-cache", "warm", "--methods", ",".join(methods))
    assert report["failed"] == {}
    ran = {row["method"] for row in report["results"] if "skipped" not in row}
    assert {"weightstream", "safetensors.load_file", "safetensors.safe_open"} <= ran


def test_bench_layered_on_a_demo_of_so_many_layers(tmp_path: Path):
    report = demo_bench(
        tmp_path,
        "--size",
        "24MiB",
        "--layers",
        "4",
        "--page-cache",
        "warm",
        "--methods",
        "weightstream,weightstream-layered",
    )
    assert {r["method"] for r in report["results"]} == {"weightstream", "weightstream-layered"}
    assert all(r["gbps_median"] > 0 for r in report["results"])
    assert [path.name for path in (tmp_path / "cache").iterdir()] == ["demo-llama-4l-512h-500v-2s"]


@pytest.mark.slow
def test_bench_an_object_store(s3_endpoint, checkpoint: Path, tmp_path: Path):
    from tests.test_objectstore import upload

    uri = upload("s3", checkpoint, "cli-bench")
    methods = ("weightstream", "limit-transport-8-ranges", "limit-obstore-16-ranges", "fsspec-sequential")
    result = cli(
        "bench", uri, "--rounds", "1", "--methods", ",".join(methods), "--json", "--plot", str(tmp_path / "s3.png")
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    by_method = {r["method"]: r for r in report["results"]}
    assert set(by_method) == set(methods) and {r["cache"] for r in report["results"]} == {"server"}
    assert all(r["gbps_median"] > 0 for r in report["results"] if "skipped" not in r)
    assert "skipped" not in by_method["weightstream"] and "skipped" not in by_method["limit-transport-8-ranges"]
    assert report["total_bytes"] == sum(
        path.stat().st_size for path in checkpoint.iterdir() if path.suffix == ".safetensors"
    )
    assert (tmp_path / "s3.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_unknown_method(checkpoint: Path):
    result = cli("bench", str(checkpoint), "--methods", "nope")
    assert result.returncode == 1
    assert "unknown method or cache ['nope']" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_cuda_refused_without_cuda_before_any_work(checkpoint: Path, tmp_path: Path):
    bench = cli("bench", "--device", "cuda", "--cache-dir", str(tmp_path / "cache"))
    assert bench.returncode == 1
    assert bench.stderr.startswith(
        "weightstream: error: bench --device cuda: torch sees no CUDA device on this machine"
    )
    assert not (tmp_path / "cache").exists(), "the demo checkpoint was built before the device was checked"
    load = cli("load", str(checkpoint), "--device", "cuda")
    assert load.returncode == 1 and "sees no CUDA device; nothing falls back to the CPU" in load.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_and_bench_on_the_gpu(checkpoint: Path, tiny_state, tmp_path: Path):
    load = cli("load", str(checkpoint), "--json", "--device", "cuda")
    assert load.returncode == 0, load.stderr
    assert json.loads(load.stdout)["tensors"] == len(tiny_state)
    bench = cli(
        "bench",
        str(checkpoint),
        "--device",
        "cuda",
        "--rounds",
        "1",
        "--page-cache",
        "warm",
        "--methods",
        "weightstream,safetensors.load_file,limit-h2d-pinned",
        "--json",
    )
    assert bench.returncode == 0, bench.stderr
    report = json.loads(bench.stdout)
    assert report["device"] == "cuda"
    ours = next(r for r in report["results"] if r["method"] == "weightstream")
    assert ours["gbps_median"] > 0 and ours["peak_device_bytes_median"] > 0 and ours["peak_pinned_bytes_median"] > 0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1GiB", 2**30),
        ("512MiB", 2**29),
        ("4G", 4 * 10**9),
        ("100", 100),
        ("1.5k", 1500),
        ("2T", 2 * 10**12),
        ("1TiB", 2**40),
        ("64Gi", 64 << 30),
        ("1Ti", 2**40),
        ("512Mi", 512 << 20),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("9" * 400, "not a size"),
        ("99999999999999999999", "too large a size"),
        ("1.5.5G", "not a size"),
        ("12 parsecs", "not a size"),
        ("-1G", "not a size"),
    ],
)
def test_parse_size_refuses_what_is_no_size(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_size(text)


def test_inspect_of_a_lone_surrogate_name_is_a_typed_error(tmp_path: Path):
    path = raw_file(
        tmp_path / "bad.safetensors", b'{"\\ud800": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}', b"ab"
    )
    result = cli("inspect", str(path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert re.search(
        r"weightstream: error: .*bad.safetensors: header holds a string with a lone surrogate \(U\+D800\)",
        result.stderr,
    )


def test_inspect_escapes_terminal_control_characters(tmp_path: Path):
    hostile = "model.\x1b[2J\x1b]0;owned\x07layers.0.w\u202e"
    path = raw_file(
        tmp_path / "ansi.safetensors",
        {"__metadata__": {"note": "\x1b[31mred"}, hostile: {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}},
        b"ab",
    )
    text = cli("inspect", str(path))
    assert text.returncode == 0, text.stderr
    assert "\x1b" not in text.stdout and "\x07" not in text.stdout and "\u202e" not in text.stdout
    assert "model.\\x1b[2J\\x1b]0;owned\\x07layers.0.w\\u202e" in text.stdout and "\\x1b[31mred" in text.stdout
    exact = cli("inspect", str(path), "--json")
    assert json.loads(exact.stdout)["tensors"][0]["name"] == hostile  # JSON output stays exact


def test_version_and_log_levels(checkpoint: Path, tmp_path: Path):
    from weightstream import __version__

    version = cli("--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"weightstream {__version__}")
    nobody = str(tmp_path / "nobody.sock")
    quiet = cli("load", str(checkpoint), "--cache", "auto", "--json", env_extra={"WEIGHTSTREAM_CACHE": nobody})
    assert quiet.returncode == 0 and quiet.stderr == ""
    told = cli(
        "--log-level", "debug", "load", str(checkpoint), "--cache", "auto", env_extra={"WEIGHTSTREAM_CACHE": nobody}
    )
    assert told.returncode == 0
    assert f"weightstream: INFO: cache='auto': no weightstream cache daemon at {nobody}: no such socket" in told.stderr
    from_environment = cli(
        "load",
        str(checkpoint),
        "--cache",
        "auto",
        env_extra={"WEIGHTSTREAM_CACHE": nobody, "WEIGHTSTREAM_LOG": "debug"},
    )
    assert "weightstream: INFO: cache='auto'" in from_environment.stderr
    wrong = cli("load", str(checkpoint), env_extra={"WEIGHTSTREAM_LOG": "loud"})
    assert (wrong.returncode, wrong.stderr.strip()) == (
        2,
        "weightstream: error: WEIGHTSTREAM_LOG='loud': not a log level (debug, info, warning, error)",
    )


def test_an_abbreviated_option_is_refused_not_guessed(checkpoint: Path):
    result = cli("load", str(checkpoint), "--thread", "4")
    assert result.returncode == 2
    assert "unrecognized arguments: --thread 4" in result.stderr


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    from weightstream import cli as command_line
    from weightstream.cli import reading

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(reading, "_inspect", interrupted)
    assert command_line.main(["inspect", "anything"]) == 130
    assert capsys.readouterr().err == "weightstream: interrupted\n"


def test_help_and_version_import_no_torch():
    """``--help`` and ``--version`` answer at once: building the parser imports no torch (nor any backend)."""
    script = "import sys, weightstream.cli as cli\ncli._parser()\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
    from weightstream.bench.methods import METHODS_BY_DEVICE
    from weightstream.bench.runner import CACHES
    from weightstream.cli import BENCH_CACHES, BENCH_DEVICES

    assert (BENCH_DEVICES, BENCH_CACHES) == (tuple(METHODS_BY_DEVICE), CACHES)
