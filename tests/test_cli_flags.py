"""The command line speaks its own flags: errors name ``--chunk-mib``, not ``chunk_bytes``; usage errors show the
usage of the command given; ``--filter`` takes patterns; storage options reach the source; ``bench --size`` is
honoured or refused. Run as a user runs it, through a subprocess, and through ``cli.main``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import save_hf_sharded
from weightstream.cli import main


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", *args], capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture
def checkpoint(tmp_path: Path, tiny_state) -> Path:
    return save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2)


@pytest.mark.parametrize(
    ("arguments", "status", "said"),
    [
        (["--chunk-mib", "0"], 2, "argument --chunk-mib: not a whole number of 1 or more: '0'"),
        (["--threads", "-1"], 2, "argument --threads: not a whole number of 1 or more: '-1'"),
        (
            ["--format", "safetensors", "--max-inflight-mib", "64"],
            1,
            "--max-inflight-mib: an option of --format streaming; the safetensors loader does not use it",
        ),
        (
            ["--prefetch-layers", "2"],
            1,
            (
                "--prefetch-layers: an option of --format layered; --format auto (safetensors or streaming or "
                "sharded-state) does not use it"
            ),
        ),
        (["--pin-memory", "yes"], 2, "--pin-memory takes no value or 'auto', got 'yes'"),
        (["--rank", "1"], 1, "--rank: an option of --format sharded-state; the safetensors loader does not use it"),
    ],
)
def test_load_errors_name_the_flags(checkpoint: Path, arguments, status, said, capsys):
    try:
        returned = main(["load", str(checkpoint), *arguments])
    except SystemExit as exited:  # a usage error: argparse exits
        returned = exited.code
    assert returned == status
    error = capsys.readouterr().err
    assert said in error
    assert not any(name in error for name in ("chunk_bytes", "max_inflight_bytes", "prefetch_layers", "format='"))


def test_a_window_error_speaks_mib_and_the_rule(tmp_path: Path, capsys):
    """A window too small for the largest tensor is told in the flag's own unit, with the size that works."""
    import torch
    from safetensors.torch import save_file

    save_file({"big": torch.zeros(3 << 18), "small": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    arguments = ["--format", "streaming", "--chunk-mib", "1", "--max-inflight-mib", "2"]
    assert main(["load", str(tmp_path / "model.safetensors"), *arguments]) == 1
    error = capsys.readouterr().err
    assert "--max-inflight-mib 2 cannot hold tensor 'big'" in error, error
    assert "so at least 4 MiB here; or leave it unset" in error, error
    assert not any(word in error for word in ("max_inflight_bytes", "None", "2097152 ("))


def test_device_errors_in_flags(checkpoint: Path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    result = cli("load", str(checkpoint), "--device", "cuda")
    assert result.returncode == 1
    assert result.stderr.strip().endswith("nothing falls back to the CPU: pass --device cpu to load there")
    pinned = cli("load", str(checkpoint), "--pin-memory")
    assert pinned.returncode == 1
    assert "--pin-memory needs CUDA" in pinned.stderr and "use --pin-memory auto to pin only" in pinned.stderr
    auto = cli("load", str(checkpoint), "--pin-memory", "auto", "--json")
    assert auto.returncode == 0, auto.stderr


def test_a_mistyped_option_shows_the_usage_of_its_command(checkpoint: Path):
    load = cli("load", str(checkpoint), "--thread", "4")
    assert load.returncode == 2
    assert load.stderr.startswith("usage: weightstream load ")
    assert "weightstream load: error: unrecognized arguments: --thread 4" in load.stderr
    cache = cli("cache", "stats", "--bogus")
    assert cache.returncode == 2
    assert cache.stderr.startswith("usage: weightstream cache stats ")


def test_filter_takes_names_and_patterns(checkpoint: Path, tiny_state):
    result = cli("load", str(checkpoint), "--json", "--filter", "model.layers.1.*", "lm_head.weight")
    assert result.returncode == 0, result.stderr
    expected = [name for name in tiny_state if name.startswith("model.layers.1.") or name == "lm_head.weight"]
    assert json.loads(result.stdout)["tensors"] == len(expected)


def test_a_filter_that_selects_nothing_is_refused_before_reading(checkpoint: Path, tiny_state):
    result = cli("load", str(checkpoint), "--filter", "model.layers.1.*", "model.layer.9.*", "nope")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"weightstream: error: {checkpoint}: --filter 'model.layer.9.*' 'nope' selects none of its "
        f"{len(tiny_state)} tensors"
    )


def test_storage_options_reach_the_source(checkpoint: Path, tmp_path: Path):
    """A mistyped storage option of an HTTP source is refused by the source, in the command line's words; the same
    options from a file and from flags, flags winning."""
    uri = "http://127.0.0.1:9/model.safetensors"
    result = cli("inspect", uri, "--storage-option", "hedaers={}")
    assert result.returncode == 1
    assert "--storage-option" in result.stderr and "hedaers" in result.stderr, result.stderr
    options = tmp_path / "options.json"
    options.write_text(json.dumps({"hedaers": {}}))
    from_file = cli("inspect", uri, "--storage-options-file", str(options))
    assert from_file.returncode == 1 and "hedaers" in from_file.stderr
    options.write_text("[1, 2]")
    not_object = cli("inspect", str(checkpoint), "--storage-options-file", str(options))
    assert not_object.returncode == 1
    assert f"--storage-options-file {options}: holds a JSON list, not an object of settings" in not_object.stderr
    malformed = cli("inspect", str(checkpoint), "--storage-option", "no-equals-sign")
    assert malformed.returncode == 2 and "not KEY=VALUE: 'no-equals-sign'" in malformed.stderr


def test_key_values_are_json_where_they_are_json():
    from weightstream.arguments import storage_option as _key_value

    assert _key_value("anon=true") == ("anon", True)
    assert _key_value("endpoint_url=http://localhost:8333") == ("endpoint_url", "http://localhost:8333")
    assert _key_value('key="123"') == ("key", "123")
    assert _key_value('token={"type": "x"}') == ("token", {"type": "x"})


def test_bench_size_is_honoured_or_refused(tmp_path: Path):
    cache = tmp_path / "cache"
    refused = cli("bench", "--size", "512", "--cache-dir", str(cache), "--methods", "weightstream")
    assert refused.returncode == 1
    assert "a demo checkpoint of 512 bytes: the closest Llama shape holds" in refused.stderr
    assert not cache.exists() or not os.listdir(cache)
    too_few_layers = cli("bench", "--size", "64GiB", "--layers", "1", "--cache-dir", str(cache))
    assert too_few_layers.returncode == 1 and "or another number of layers" in too_few_layers.stderr


def test_bench_page_cache_is_not_the_node_cache(tmp_path: Path):
    """``--cache`` means the node cache daemon wherever it is taken; bench's page-cache states are ``--page-cache``."""
    result = cli("bench", "--cache", "warm", "--cache-dir", str(tmp_path))
    assert result.returncode == 2 and "weightstream bench: error: unrecognized arguments: --cache" in result.stderr


def test_every_option_of_every_command_says_what_it_does():
    import argparse

    from weightstream.cli import _parser

    silent = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, command in action.choices.items():
                    walk(command, [*path, name])
            elif not action.help:
                silent.append(" ".join([*path, *(action.option_strings or [action.dest])]))

    walk(_parser(), ["weightstream"])
    assert silent == []
    load_help = _parser()._subparsers._group_actions[0].choices["load"].format_help()  # type: ignore[union-attr]
    assert "auto (default), safetensors, streaming, layered, sharded-state, distributed" in " ".join(load_help.split())


def test_the_formats_help_lists_are_the_registry():
    from weightstream.cli.reading import BUILT_IN_FORMATS
    from weightstream.registry import BUILTIN_LOADERS

    assert BUILT_IN_FORMATS == tuple(BUILTIN_LOADERS)


def test_verbose_shows_what_weightstream_chose(checkpoint: Path):
    quiet = cli("load", str(checkpoint), "--max-inflight-mib", "64", "--json")
    assert quiet.returncode == 0 and quiet.stderr == ""
    told = cli("-v", "load", str(checkpoint), "--max-inflight-mib", "64", "--json")
    assert told.returncode == 0
    assert told.stderr.strip() == (
        "weightstream: INFO: format='auto': max_inflight_bytes asks for the streaming loader, not safetensors"
    )
    assert json.loads(told.stdout)["format"] == "streaming"
    nobody = str(checkpoint.parent / "nobody.sock")
    debug = subprocess.run(
        [sys.executable, "-m", "weightstream.cli", "-vv", "load", str(checkpoint), "--cache", "auto", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "WEIGHTSTREAM_CACHE": nobody},
    )
    assert f"weightstream: INFO: cache='auto': no weightstream cache daemon at {nobody}" in debug.stderr


@pytest.mark.parametrize(("stop", "code", "said"), [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_ctrl_c_or_sigterm_mid_request_is_one_line_and_leaves_nothing(tmp_path: Path, stop: str, code: int, said: str):
    """A load waiting on a server that accepted and never answers: SIGINT (Ctrl-C) or SIGTERM (kill, a container
    stopping) ends it at once, one line, exit 130 or 143, no traceback, no temporary file, no process left."""
    import signal
    import socket
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "weightstream.cli", "load", f"http://127.0.0.1:{silent.getsockname()[1]}/m.safetensors"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    try:
        connection, _ = silent.accept()  # the load's first request has reached the server
        time.sleep(0.5)
        process.send_signal(getattr(signal, stop))
        stdout, stderr = process.communicate(timeout=120)  # a hang guard: a busy machine's teardown is slow
        connection.close()
    finally:
        silent.close()
        if process.poll() is None:
            process.kill()
    assert (process.returncode, stdout, stderr) == (code, "", f"weightstream: {said}\n")
    assert list(scratch.iterdir()) == []
