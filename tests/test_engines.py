"""The engine adapters without an engine: importing them imports none; which parameter bytes a load
wrote; models built with their parameters on meta."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.engines.materialise import materialise, move_parameter, parameters_on_meta
from weightstream.engines.writes import WriteRecorder


def test_importing_weightstream_and_its_adapters_imports_no_engine():
    script = (
        "import sys, weightstream, weightstream.engines.vllm, weightstream.engines.sglang, "
        "weightstream.engines.common; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


class Fused(torch.nn.Module):
    """A fused projection (three parts in one parameter, filled by part) and a rotary-like buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.empty(6, 4), requires_grad=False)
        self.qkv.weight_loader = self.load_part
        self.norm = torch.nn.Parameter(torch.ones(4))
        self.register_buffer("cache", torch.arange(8.0), persistent=False)

    def load_part(self, parameter: torch.Tensor, tensor: torch.Tensor, part: int) -> None:
        parameter.data.narrow(0, 2 * part, 2).copy_(tensor)


def test_a_fused_parameter_is_filled_only_when_every_part_came():
    model = Fused()
    with WriteRecorder() as writes:
        for part in (0, 2):
            model.qkv.weight_loader(model.qkv, torch.ones(2, 4), part)
        model.norm.data.copy_(torch.zeros(4))
    assert writes.unfilled(dict(model.named_parameters())) == ["qkv"]
    with writes:
        model.qkv.weight_loader(model.qkv, torch.ones(2, 4), 1)
    assert writes.unfilled(dict(model.named_parameters())) == []


def test_writes_outside_the_recorder_or_on_other_threads_do_not_count():
    import threading

    weight = torch.zeros(3, 3)
    weight.fill_(1.0)
    with WriteRecorder() as writes:
        thread = threading.Thread(target=weight.fill_, args=(2.0,))
        thread.start()
        thread.join()
    assert writes.unfilled({"weight": weight}) == ["weight"]


def test_forget_drops_what_memory_held_before_it_was_given_out():
    weight = torch.zeros(4)
    with WriteRecorder() as writes:
        weight.fill_(1.0)
    writes.forget([weight])
    assert writes.unfilled({"weight": weight}) == ["weight"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 11), st.integers(1, 12)), max_size=6))
def test_unfilled_is_exactly_whether_every_element_was_written(spans):
    weight = torch.zeros(12)
    written = torch.zeros(12, dtype=torch.bool)
    with WriteRecorder() as writes:
        for start, length in spans:
            weight[start : start + length].fill_(1.0)
            written[start : start + length] = True
    assert writes.unfilled({"weight": weight}) == ([] if bool(written.all()) else ["weight"])


def test_a_strided_write_counts_as_its_span_and_a_meta_parameter_as_unfilled():
    weight = torch.zeros(3, 4)
    with WriteRecorder() as writes:
        weight[:, 0].fill_(1.0)
        weight[2, 1:].fill_(1.0)
    assert writes.unfilled({"weight": weight}) == [], "columns 1-3 of rows 0-1 lie inside the column write's span"
    with parameters_on_meta():
        layer = torch.nn.Linear(2, 2)
    assert writes.unfilled(dict(layer.named_parameters())) == ["weight", "bias"]


def test_parameters_on_meta_keeps_buffers_attributes_and_identity():
    with parameters_on_meta():
        model = Fused()
    assert model.qkv.device.type == "meta" and model.norm.device.type == "meta"
    assert torch.equal(model.cache, torch.arange(8.0)), "buffers keep what __init__ computed"
    qkv = model.qkv
    assert materialise(model, "", torch.device("cpu")) == [model.qkv, model.norm]
    assert (
        model.qkv is qkv
        and model.qkv.weight_loader == model.load_part
        and not model.qkv.requires_grad
        and model.norm.requires_grad
    )
    assert isinstance(model.norm, torch.nn.Parameter) and model.norm.device.type == "cpu"


def test_parameters_on_meta_is_undone_when_construction_fails():
    register = torch.nn.Module.register_parameter
    with pytest.raises(ZeroDivisionError), parameters_on_meta():
        torch.nn.Linear(2, 2)
        raise ZeroDivisionError
    assert torch.nn.Module.register_parameter is register
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"


def test_materialise_gives_tied_aliases_one_memory():
    with parameters_on_meta():
        model = torch.nn.Module()
        model.embed = torch.nn.Embedding(4, 2)
        model.head = torch.nn.Linear(2, 4, bias=False)
    model.head.weight = model.embed.weight
    assert len(materialise(model, "head", torch.device("cpu"))) == 1
    assert model.embed.weight.device.type == "cpu" and model.head.weight is model.embed.weight


def test_move_parameter_keeps_a_subclass():
    class Tagged(torch.nn.Parameter):
        @property
        def tag(self) -> str:
            return self._tag

    weight = Tagged(torch.zeros(2))
    weight._tag = "kept"
    move_parameter(weight, "meta")
    assert type(weight) is Tagged and weight.tag == "kept" and weight.device.type == "meta"


@pytest.mark.parametrize(("version", "warned"), [("0.32.0", False), ("0.99.1", True)])
def test_a_vllm_outside_the_checked_versions_is_warned_about_once(monkeypatch, caplog, version, warned):
    """A stand-in ``vllm`` module carries the version (vLLM itself runs in tests/test_vllm.py)."""
    import types

    from weightstream.engines import vllm_private

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    vllm_private.checked_version.cache_clear()
    with caplog.at_level("WARNING", logger="weightstream"):
        assert [vllm_private.checked_version(), vllm_private.checked_version()] == [not warned] * 2
    vllm_private.checked_version.cache_clear()
    expected = (
        [
            (
                f"vLLM {version}: weightstream's vLLM adapter was checked on vLLM 0.32.0; it uses vLLM internals "
                "(ShardedStateLoader._filter_subtensors) that may differ in this version"
            )
        ]
        if warned
        else []
    )
    assert [record.getMessage() for record in caplog.records] == expected


@pytest.mark.parametrize(("version", "warned"), [("0.5.23", False), ("0.6.0", True)])
def test_an_sglang_outside_the_checked_versions_is_warned_about_once(monkeypatch, caplog, version, warned):
    from weightstream.engines import sglang_private

    monkeypatch.setattr(sglang_private.metadata, "version", lambda name: version)
    sglang_private.checked_version.cache_clear()
    with caplog.at_level("WARNING", logger="weightstream"):
        assert [sglang_private.checked_version(), sglang_private.checked_version()] == [not warned] * 2
    sglang_private.checked_version.cache_clear()
    messages = [record.getMessage() for record in caplog.records]
    assert messages == (
        [
            (
                f"SGLang {version}: weightstream's SGLang adapter was checked on SGLang 0.5.23; it uses "
                "SGLang internals (its model loader's helpers) that may differ in this version"
            )
        ]
        if warned
        else []
    )


def test_the_engines_private_names_are_used_only_in_their_private_modules():
    root = Path(__file__).parent.parent / "weightstream" / "engines"
    private = (  # what the adapters reach into: the engines' model-loader internals
        "._filter_subtensors",
        "_get_quantization_config",
        "_initialize_model",
        "LoadConfig._verify_load_format",
        "sglang.srt.model_loader.loader import",
        "sglang.srt.model_loader.utils",
        "sglang.srt.distributed import",
        "vllm.model_executor.model_loader.sharded_state_loader",
    )
    for module in sorted(root.glob("*.py")):
        if module.name in ("vllm_private.py", "sglang_private.py"):
            continue
        text = module.read_text()
        assert not [name for name in private if name in text], module.name


def test_the_documented_vllm_recipe_is_what_the_vllm_tests_install():
    """docs/engines.md's install lines are the ones tests/engine_envs.py runs for tests/test_vllm.py."""
    import re

    from tests.engine_envs import BROKEN_BESIDE_CPU_TORCH, VLLM

    text = (Path(__file__).parent.parent / "docs" / "engines.md").read_text()
    recipe = re.search(r"tests/engine_envs.py installs these same pins.*?\n```bash\n(.*?)\n```", text, re.DOTALL)
    assert recipe is not None, "docs/engines.md lost its vLLM install recipe"
    lines = recipe.group(1).splitlines()
    assert lines[1:] == [
        f"pip install {' '.join(VLLM)}",
        f"pip uninstall -y {' '.join(BROKEN_BESIDE_CPU_TORCH)}",
        "pip install 'weightstream[s3]'",
    ]


@pytest.mark.parametrize(
    ("model", "model_weights", "read"),
    [("/tmp/vllm-config-copy", "s3://bucket/llama", "s3://bucket/llama"), ("/models/llama", "", "/models/llama")],
)
def test_vllm_loaders_read_the_weights_where_vllm_was_told_they_are(model, model_weights, read):
    """``--model s3://...``: vLLM puts the config in a local directory (``model``) and keeps the URI as
    ``model_weights``. A stand-in base class and config carry vLLM's attributes (vLLM runs in tests/test_vllm.py)."""
    import types

    from weightstream.engines.vllm import _loader_class

    class Base:
        def __init__(self, load_config):
            self.load_config = load_config

    loader_class = _loader_class(Base, "weightstream", "auto")
    loader = loader_class(types.SimpleNamespace(model_loader_extra_config={"threads": 4}, download_dir=None))
    config = types.SimpleNamespace(model=model, model_weights=model_weights, revision=None)
    assert loader._located(config) == (read, {"threads": 4})
