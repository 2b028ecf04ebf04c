"""The grouping rules of the layered loader, on names alone: properties over generated checkpoints."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from weightstream.errors import InvalidOptionError
from weightstream.planning.layers import compile_rule, group_layers
from weightstream.planning.plan import TensorSpec

PROJECTIONS = ["self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm"]


@st.composite
def llama_names(draw) -> tuple[list[str], int, set[str]]:
    """Names of a Llama-like checkpoint in a random stored order: the layer count, and the extras."""
    layers = draw(st.integers(min_value=0, max_value=30))
    experts = draw(st.integers(min_value=0, max_value=3))
    names = []
    for layer in range(layers):
        for projection in draw(st.lists(st.sampled_from(PROJECTIONS), min_size=1, max_size=5, unique=True)):
            names.append(f"model.layers.{layer}.{projection}.weight")
        names += [f"model.layers.{layer}.mlp.experts.{e}.w1.weight" for e in range(experts)]
    extras = set(
        draw(
            st.lists(
                st.sampled_from(["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "score.bias"]),
                unique=True,
            )
        )
    )
    names += sorted(extras)
    return draw(st.permutations(names)), layers, extras


def specs(names: list[str]) -> list[TensorSpec]:
    return [TensorSpec(name, torch.uint8, (1,), "f", offset, 1) for offset, name in enumerate(names)]


@given(llama_names())
def test_every_tensor_once_layers_in_order_embeddings_first_head_last(case):
    names, layers, extras = case
    grouped = group_layers(specs(names))
    assert sorted(spec.name for layer in grouped for spec in layer.tensors) == sorted(names)
    keys = [layer.key for layer in grouped]
    assert len(keys) == len(set(keys))
    numbered = [key for key in keys if key.startswith("model.layers.")]
    assert numbered == [f"model.layers.{n}" for n in range(layers)]
    if "model.embed_tokens.weight" in extras:
        assert keys[0] == "model.embed_tokens"
    if "lm_head.weight" in extras:
        assert keys[-1] == "lm_head"
    if "model.norm.weight" in extras and numbered:
        assert keys.index("model.norm") > keys.index(numbered[-1])
    for layer in grouped:
        assert all(spec.name.startswith(layer.key + ".") for spec in layer.tensors)
        offsets = [spec.offset for spec in layer.tensors]
        assert offsets == sorted(offsets), "within a layer, tensors keep their stored order"


@given(llama_names(), st.integers(min_value=1, max_value=4))
def test_a_callable_rule_is_applied_to_every_name(case, width):
    names, _, _ = case

    def rule(name: str) -> str:
        match = re.search(r"layers\.(\d+)\.", name)
        return f"group.{int(match.group(1)) // width}" if match else "other"

    grouped = group_layers(specs(names), compile_rule(rule))
    for layer in grouped:
        assert {rule(spec.name) for spec in layer.tensors} == {layer.key}
    numbers = [int(layer.key.split(".")[1]) for layer in grouped if layer.key.startswith("group.")]
    assert numbers == sorted(numbers)


@given(st.lists(st.text(alphabet="ab.0123456789_", min_size=1, max_size=12), unique=True, max_size=40))
def test_any_names_group_without_error_and_lose_nothing(names):
    grouped = group_layers(specs(names))
    assert sorted(spec.name for layer in grouped for spec in layer.tensors) == sorted(names)


def test_layer_numbers_of_thousands_of_digits_sort_like_numbers():
    huge = "9" * 5000
    specs = [
        TensorSpec(f"model.layers.{number}.w", torch.uint8, (1,), "f", position, 1)
        for position, number in enumerate([huge, "10", "2", "0" + huge])
    ]
    order = [layer.key for layer in group_layers(specs)]
    assert order == ["model.layers.2", "model.layers.10", f"model.layers.{huge}", f"model.layers.0{huge}"]


def test_a_rule_capturing_non_ascii_digits_is_refused():
    specs = [TensorSpec("h.²³.w", torch.uint8, (1,), "f", 0, 1)]
    with pytest.raises(InvalidOptionError, match=r"captured '²³' from tensor 'h.²³.w': not a layer number"):
        group_layers(specs, compile_rule(r"^h\.([^.]+)\."))
