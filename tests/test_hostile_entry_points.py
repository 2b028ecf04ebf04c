"""Every entry point that opens a small file of the user's refuses what is not a regular file at once (a FIFO
would block it forever, a link to ``/dev/zero`` would never end) and says so in one typed line: the Hub cache's
refs, token and index, the Docker config, ``convert``'s ``config.json``, ``push``'s files."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import weightstream
from tests.conftest import save_hf_sharded
from tests.hub import cache_model
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.errors import SourceError, UnsupportedInputError

ROOT = Path(__file__).resolve().parent.parent
SHAPE = LlamaShape(hidden=64, intermediate=160, layers=2, vocab=96)
pytestmark = pytest.mark.timeout(60)  # a hang is the failure these tests look for


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch) -> Path:
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    for name in ("HF_TOKEN", "HF_HOME", "HF_TOKEN_PATH", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def cached_ref(offline_cache: Path, tmp_path: Path) -> Path:
    """The ``refs/main`` of a model in the offline cache, removed for the test to put something else there."""
    model = save_hf_sharded(llama_state_dict(SHAPE, seed=1), tmp_path / "model", shards=1)
    cache_model(offline_cache, "org/llama", Path(model))
    ref = offline_cache / "models--org--llama" / "refs" / "main"
    ref.unlink()
    return ref


def test_a_fifo_as_a_hub_ref_is_refused_at_once(offline_cache, tmp_path, no_leaks):
    ref = cached_ref(offline_cache, tmp_path)
    os.mkfifo(ref)
    with pytest.raises(UnsupportedInputError, match=rf"^{ref}: is a FIFO, not a regular file"):
        weightstream.load_weights("hf://org/llama")


def test_a_loop_of_links_as_a_hub_ref_is_a_typed_error(offline_cache, tmp_path, no_leaks):
    ref = cached_ref(offline_cache, tmp_path)
    ref.symlink_to(ref)
    with pytest.raises(SourceError, match=rf"^{ref}: cannot open: Too many levels of symbolic links$"):
        weightstream.load_weights("hf://org/llama")


def test_a_fifo_as_the_hub_token_file_is_refused_at_once(offline_cache, tmp_path, monkeypatch, no_leaks):
    token = tmp_path / "token"
    os.mkfifo(token)
    monkeypatch.setenv("HF_TOKEN_PATH", str(token))
    with pytest.raises(UnsupportedInputError, match=rf"^{token}: is a FIFO, not a regular file"):
        weightstream.load_weights("hf://org/llama")


def test_a_fifo_as_the_docker_config_is_refused_at_once(tmp_path, monkeypatch, no_leaks):
    from weightstream.sources.oci.auth import docker_credentials

    os.mkfifo(tmp_path / "config.json")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    with pytest.raises(UnsupportedInputError, match=r"config.json: is a FIFO, not a regular file"):
        docker_credentials("registry.example:5000")


def cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "weightstream.cli", *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT, timeout=60)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return Path(save_hf_sharded(llama_state_dict(SHAPE, seed=2), tmp_path / "ckpt", shards=1))


def test_convert_refuses_tp_0_in_one_line(checkpoint, tmp_path):
    result = cli("convert", str(checkpoint), str(tmp_path / "out"), "--to", "sharded-state", "--tp", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith("argument --tp: not a whole number of 1 or more: '0'")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("[1, 2]", r"config.json: a model's config.json is a JSON object, this is a list"),
        ("[" * 100_000 + "]" * 100_000, r"--engine needs the model's config.json beside the checkpoint \(.*\): "),
        ("fifo", r"--engine needs the model's config.json beside the checkpoint \(.*\): .*is a FIFO"),
    ],
    ids=["a list", "nested 100,000 deep", "a FIFO"],
)
def test_convert_refuses_a_config_that_is_no_model_config_in_one_line(checkpoint, tmp_path, config, message):
    if config == "fifo":
        os.mkfifo(checkpoint / "config.json")
    else:
        (checkpoint / "config.json").write_text(config)
    result = cli(
        "convert", str(checkpoint), str(tmp_path / "out"), "--to", "sharded-state", "--tp", "2", "--engine", "vllm"
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("weightstream: error: ")
    assert re.search(message, line), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["FIFO", "link to /dev/zero", "dangling link", "socket"])
def test_push_refuses_what_is_not_a_regular_file_before_any_request(tmp_path, kind):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"weights")
    odd = directory / "odd"
    bound = None
    if kind == "FIFO":
        os.mkfifo(odd)
        expected = f"{odd}: is a FIFO, not a regular file"
    elif kind == "link to /dev/zero":
        odd.symlink_to("/dev/zero")
        expected = f"{odd}: is a character device, not a regular file"
    elif kind == "dangling link":
        odd.symlink_to(tmp_path / "gone")
        expected = f"{odd}: no such file"
    else:
        bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound.bind(str(odd))
        expected = f"{odd}: cannot open: No such device or address"
    try:
        result = cli("push", str(directory), "oci://127.0.0.1:9/models/llama:v1")  # port 9: nothing may be asked
    finally:
        if bound is not None:
            bound.close()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().startswith(f"weightstream: error: {expected}"), result.stderr
    assert "127.0.0.1:9" not in result.stderr


def test_the_helper_reads_a_regular_file_and_refuses_a_long_one(tmp_path):
    from weightstream.sources.local.regular import read_regular

    (tmp_path / "small").write_bytes(b"x" * 10)
    assert read_regular(str(tmp_path / "small"), 10) == b"x" * 10
    with pytest.raises(UnsupportedInputError, match=r"small: 10 bytes, more than the 9 a file of its kind holds"):
        read_regular(str(tmp_path / "small"), 9)
