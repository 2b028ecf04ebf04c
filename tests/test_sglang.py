"""The SGLang adapter with the real ``sglang`` package (no engine: SGLang runs on no CPU), in one
process of the SGLang environment (``tests/engine_envs.py``, ``tests/sglang_check.py``): our plugin
loaded by SGLang's plugin loader, ``--load-format`` parsed by its CLI, our loader returned by its
``get_model_loader``, and SGLang's own Llama class built and filled by every weightstream format,
bit for bit as SGLang's ``auto`` fills it (parameters and buffers). Negative controls.
The adapter's own checks without SGLang run in this environment."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.cache_daemon import Daemon, places, remove
from tests.engine_envs import ENGINE_TEST_TIMEOUT

FORMATS = [
    "weightstream",
    "weightstream-distributed",
    "weightstream-layered",
    "weightstream-safetensors",
    "weightstream-sharded-state",
    "weightstream-streaming",
]

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)  # the first test builds the engine environment


def converted(model: Path, directory: Path) -> Path:
    """``weightstream convert --engine sglang --tp 1`` of ``model``, its config beside it (SGLang runs a CPU rank of
    one)."""
    from weightstream.save.convert import convert_to_sharded_state

    convert_to_sharded_state(model, directory, tp=1, engine="sglang")
    for path in model.glob("*.json"):
        if path.name != "model.safetensors.index.json":
            shutil.copy(path, directory / path.name)
    return directory


@pytest.fixture(scope="module")
def sglang(s3_endpoint, tmp_path_factory) -> tuple[dict, dict[str, Path]]:
    """Every case in one SGLang process: each case's result, and the paths used."""
    from tests.engine_envs import run_in_engine, sglang_environment
    from tests.engine_model import altered, variant, without_head, without_v_proj
    from tests.hub import cache_model
    from tests.objstore import free_port
    from tests.test_objectstore import upload

    python, environment = sglang_environment()
    work = tmp_path_factory.mktemp("sglang")
    model = work / "tiny"
    run_in_engine(python, "tests.engine_model", str(model))
    cache_model(work / "hf-cache", "org/tiny", model)
    environment = {**environment, "HF_HUB_CACHE": str(work / "hf-cache"), "HF_HUB_OFFLINE": "1"}
    paths = {
        "model": model,
        "ours": work / "state-ours",
        "sglangs": work / "state-sglang",
        "headless": variant(model, work / "headless", without_head),
    }
    s3_uri = upload("s3", model, f"sglang-{work.name}")
    paths["converted"] = converted(model, work / "converted-tp1")
    cli = ["--model-path", str(model), "--device", "cpu"]
    segments, sock = places("sglang")
    request = {
        "model": str(model),
        "port": free_port(),
        "cli": {
            "cli-layered": [
                *cli,
                "--load-format",
                "weightstream-layered",
                "--model-loader-extra-config",
                json.dumps({"uri": s3_uri, "threads": 2}),
            ],
            "cli-auto": [*cli, "--load-format", "auto"],
            "cli-unknown": [*cli, "--load-format", "weightstream-nonesuch"],
        },
        "save": {"save-ours": [str(paths["ours"]), "weightstream"], "save-sglangs": [str(paths["sglangs"]), "sglang"]},
        "cases": {
            "auto": {"model": str(model), "load_format": "auto"},
            "weightstream": {"model": str(model), "load_format": "weightstream"},
            "weightstream-cold": {"model": str(model), "load_format": "weightstream", "cold": True},
            "safetensors": {
                "model": str(model),
                "load_format": "weightstream-safetensors",
                "extra": {"zero_copy": False, "threads": 2, "chunk_bytes": 65536},
            },
            "layered": {"model": str(model), "load_format": "weightstream-layered", "extra": {"prefetch_layers": 1}},
            "distributed": {"model": str(model), "load_format": "weightstream-distributed"},
            "streaming-s3": {
                "model": str(model),
                "load_format": "weightstream-streaming",
                "extra": {"uri": s3_uri, "max_inflight_bytes": 1 << 20, "chunk_bytes": 256 << 10},
            },
            "class": {"model": str(model), "load_format": "class:weightstream-layered"},
            "sharded-state-ours": {
                "model": str(paths["ours"]),
                "load_format": "weightstream-sharded-state",
                "extra": {"verify": True},
            },
            "sharded-state-sglangs": {"model": str(paths["sglangs"]), "load_format": "weightstream-sharded-state"},
            "sglang-loads-ours": {"model": str(paths["ours"]), "load_format": "sharded_state"},
            "converted": {"model": str(paths["converted"]), "load_format": "weightstream-sharded-state"},
            "sglang-loads-converted": {"model": str(paths["converted"]), "load_format": "sharded_state"},
            "altered": {"model": str(variant(model, work / "altered", altered)), "load_format": "weightstream"},
            "altered-layered": {"model": str(work / "altered"), "load_format": "weightstream-layered"},
            "headless-auto": {"model": str(paths["headless"]), "load_format": "auto"},
            "headless": {"model": str(paths["headless"]), "load_format": "weightstream"},
            "headless-layered": {"model": str(paths["headless"]), "load_format": "weightstream-layered"},
            "no-v-proj": {
                "model": str(variant(model, work / "no-v-proj", without_v_proj)),
                "load_format": "weightstream-safetensors",
            },
            "hub-id-auto": {"model": "org/tiny", "load_format": "auto"},
            "hub-id": {"model": "org/tiny", "load_format": "weightstream"},
            "hub-id-layered": {"model": "org/tiny", "load_format": "weightstream-layered"},
            "hub-uri": {
                "model": str(model),
                "load_format": "weightstream-streaming",
                "extra": {"uri": "hf://org/tiny@main"},
            },
            "hub-absent": {"model": str(model), "load_format": "weightstream", "extra": {"uri": "hf://org/absent"}},
            "not-ours": {"model": str(model), "load_format": "weightstream-nonesuch"},
            "engine-owned-option": {"model": str(model), "load_format": "weightstream", "extra": {"rank": 1}},
            "unknown-option": {"model": str(model), "load_format": "weightstream", "extra": {"thread": 2}},
            "cache-cold": {"model": str(model), "load_format": "weightstream", "extra": {"cache": str(sock)}},
            "cache-warm": {"model": str(model), "load_format": "weightstream", "extra": {"cache": str(sock)}},
            "cache-layered": {
                "model": str(model),
                "load_format": "weightstream-layered",
                "extra": {"cache": str(sock)},
            },
        },
    }
    try:
        with Daemon(segments, sock):
            answer = run_in_engine(python, "tests.sglang_check", json.dumps(request), environment)
    finally:
        remove(segments, sock)
    return json.loads(answer), paths


@pytest.mark.slow
def test_sglangs_plugin_loader_adds_every_format_to_the_choices(sglang):
    results, _ = sglang
    assert results["choices"] == FORMATS


@pytest.mark.slow
def test_the_cli_parses_our_formats_and_get_model_loader_returns_our_loader(sglang):
    results, _ = sglang
    parsed = results["cli-layered"]["value"]
    assert parsed["load_format"] == "weightstream-layered"
    assert (parsed["loader"], parsed["loader_module"]) == (
        "WeightstreamModelLoader_weightstream_layered",
        "weightstream.engines.sglang",
    )
    assert parsed["options"] == {"threads": 2} and parsed["uri"].startswith("s3://")
    assert results["cli-auto"]["value"]["loader"] == "DefaultModelLoader", "SGLang's own formats are still its own"
    assert results["cli-unknown"]["error"] == ["SystemExit", "2"], (
        "argparse still refuses names that are not in the choices"
    )


@pytest.mark.slow
def test_every_format_fills_sglangs_llama_as_its_own_loader_does(sglang):
    results, _ = sglang
    reference = results["auto"]
    assert (
        "model.layers.0.self_attn.qkv_proj.weight" in reference["names"]
        and "model.layers.0.self_attn.rotary_emb.cos_sin_cache" in reference["names"]
    )
    for name in (
        *("weightstream", "weightstream-cold", "safetensors", "layered", "distributed", "streaming-s3", "class"),
        *("cache-cold", "cache-warm", "cache-layered"),
    ):
        assert results[name].get("differ") == [] and results[name]["names"] == reference["names"], (name, results[name])
    assert results["layered"]["loader"] == "WeightstreamModelLoader_weightstream_layered"


@pytest.mark.slow
def test_a_hugging_face_id_loads_from_an_offline_cache_as_sglangs_own_loader_does(sglang):
    results, _ = sglang
    reference = results["auto"]
    for name in ("hub-id-auto", "hub-id", "hub-id-layered", "hub-uri"):
        assert results[name].get("differ") == [] and results[name]["names"] == reference["names"], (name, results[name])
    assert results["hub-id"]["loader"] == "WeightstreamModelLoader_weightstream"
    error = results["hub-absent"]["error"]
    assert (
        error[0] == "NotFound"
        and error[1].startswith("hf://org/absent: not in the Hugging Face cache at ")
        and "HF_HUB_OFFLINE is set" in error[1]
    ), error


@pytest.mark.slow
def test_a_cold_checkpoint_is_read_layer_by_layer_and_a_warm_one_mapped(sglang):
    results, paths = sglang
    assert any(
        said.startswith(f"{paths['model']}: ")
        and said.endswith("% in the page cache: reading it layer by layer while the engine copies")
        for said in results["weightstream-cold"]["said"]
    ), results["weightstream-cold"]["said"]
    assert not any("layer by layer" in said for said in results["weightstream"]["said"])


@pytest.mark.slow
def test_sharded_state_both_ways_with_sglangs_own(sglang):
    results, paths = sglang
    assert results["save-ours"] == {"value": None} and (paths["ours"] / "weightstream-manifest-rank-0.json").exists()
    assert (
        results["save-sglangs"] == {"value": None} and (paths["sglangs"] / "model-rank-0-part-0.safetensors").exists()
    )
    for name in ("sharded-state-ours", "sharded-state-sglangs", "sglang-loads-ours"):
        assert results[name].get("differ") == [], (name, results[name])
    assert results["sharded-state-ours"]["loader"] == "WeightstreamModelLoader_weightstream_sharded_state"


@pytest.mark.slow
def test_a_converted_checkpoint_fills_sglangs_llama_as_auto_does(sglang):
    results, _ = sglang
    for name in ("converted", "sglang-loads-converted"):
        assert results[name].get("differ") == [] and results[name]["names"] == results["auto"]["names"], (
            name,
            results[name],
        )


@pytest.mark.slow
def test_negative_controls(sglang):
    results, paths = sglang
    assert results["altered"]["differ"] == ["model.layers.1.mlp.down_proj.weight"], (
        "one tensor changed must change exactly its parameter"
    )
    assert results["altered-layered"]["differ"] == ["model.layers.1.mlp.down_proj.weight"]
    assert "differ" in results["headless-auto"], "SGLang's own loader does not notice a missing lm_head.weight"
    message = f"{paths['headless']} did not fill 1 of the model's 15 parameters: lm_head.weight"
    assert results["headless"]["error"] == ["WeightsMismatchError", message]
    assert results["headless-layered"]["error"] == ["WeightsMismatchError", message], (
        "the head's parameter never got memory: unfilled"
    )


@pytest.mark.slow
def test_a_fused_parameter_missing_a_part_is_unfilled(sglang):
    results, paths = sglang
    assert results["no-v-proj"]["error"] == [
        "WeightsMismatchError",
        (
            f"{paths['model'].parent / 'no-v-proj'} did not fill 1 of the model's 15 parameters: "
            "model.layers.0.self_attn.qkv_proj.weight"
        ),
    ]


@pytest.mark.slow
def test_bad_names_and_options_fail_when_the_loader_is_made(sglang):
    results, _ = sglang
    assert results["not-ours"]["error"] == ["ValueError", "'weightstream-nonesuch' is not a valid LoadFormat"]
    assert results["engine-owned-option"]["error"] == [
        "InvalidOptionError",
        "weightstream: rank in the extra loader config: the engine decides these",
    ]
    assert results["unknown-option"]["error"][0] == "OptionError" and results["unknown-option"]["error"][1].startswith(
        "unknown option(s) thread; known options:"
    )


@pytest.mark.skipif(__import__("importlib").util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_the_adapter_without_sglang_says_how_to_install_it():
    import weightstream
    from weightstream.engines import sglang

    with pytest.raises(
        weightstream.EngineUnavailableError,
        match=r"this weightstream adapter needs sglang, which is not installed here \(pip install sglang\)",
    ):
        sglang.register()
    with pytest.raises(weightstream.EngineUnavailableError, match=r"needs sglang"):
        sglang.loader_class("weightstream")
    with pytest.raises(
        weightstream.UnknownFormatError,
        match=r"'vllm' is not a weightstream load format; known: weightstream, weightstream-distributed",
    ):
        sglang.loader_class("vllm")
