"""The layered loader: layer order and completeness, reused buffers and the release contract, the
per-layer hook, abandonment, every source, the staged (GPU) path with the CPU engine, and the
memory envelope of a 2 GiB, 16-layer checkpoint measured in a fresh process."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

import weightstream
from tests.conftest import assert_same, save_hf_sharded, truncating_after_first_read
from tests.engines import DelayedCheckingEngine
from tests.test_objectstore import upload
from weightstream.bench.demo import LlamaShape, llama_state_dict, write_sharded
from weightstream.memory.ring import CpuStaging
from weightstream.planning.layers import group_layers
from weightstream.readers.layered import LayerReading, read_layers
from weightstream.sources import store_for

MIB = 1 << 20
SHAPE = LlamaShape(hidden=256, intermediate=704, layers=6, vocab=1000)  # layers of about 1.3 MiB


def llama(
    tmp_path: Path, shards: int = 3, seed: int = 0, shape: LlamaShape = SHAPE
) -> tuple[dict[str, torch.Tensor], str]:
    state = llama_state_dict(shape, seed=seed)
    return state, str(save_hf_sharded(state, tmp_path / "ckpt", shards=shards))


def expected_layers(state: dict[str, torch.Tensor], layers: int) -> list[tuple[str, list[str]]]:
    """Llama's layers as a model builds them: embeddings, layers 0..n-1, final norm, head."""
    order = [("model.embed_tokens", ["model.embed_tokens.weight"])]
    for layer in range(layers):
        order.append((f"model.layers.{layer}", sorted(n for n in state if n.startswith(f"model.layers.{layer}."))))
    order += [("model.norm", ["model.norm.weight"]), ("lm_head", ["lm_head.weight"])]
    return [(key, names) for key, names in order if names[0] in state]


def received(stream) -> list[tuple[str, list[str]]]:
    """Each layer's key and sorted names, checking it against nothing: the consumer drops each layer."""
    return [(key, sorted(tensors)) for key, tensors in stream]


# Order and completeness


@pytest.mark.parametrize("shards", [1, 3])
def test_layers_come_in_model_order_and_bit_exact(tmp_path: Path, shards, no_leaks):
    state, uri = llama(tmp_path, shards=shards)
    seen = []
    for key, tensors in weightstream.iter_layers(uri, chunk_bytes=64 * 1024, threads=3):
        assert_same(tensors, {name: state[name] for name in tensors})
        seen.append((key, sorted(tensors)))
    assert seen == expected_layers(state, SHAPE.layers)


def test_iter_weights_yields_the_layers_tensors_one_by_one_in_layer_order(tmp_path: Path, no_leaks):
    state, uri = llama(tmp_path)
    names = []
    for name, tensor in weightstream.iter_weights(uri, format="layered"):
        assert torch.equal(tensor.view(torch.uint8), state[name].view(torch.uint8))
        names.append(name)
    layer_of = {
        name: number for number, (_, members) in enumerate(expected_layers(state, SHAPE.layers)) for name in members
    }
    assert sorted(names) == sorted(state)
    assert [layer_of[name] for name in names] == sorted(layer_of[name] for name in names), (
        "tensors must come grouped, in layer order"
    )


def test_tied_embeddings_and_extra_tensors_outside_the_layers(tmp_path: Path, no_leaks):
    state = llama_state_dict(SHAPE)
    del state["lm_head.weight"]  # tied to the embeddings: stored once
    state["model.rotary_emb.inv_freq"] = torch.arange(64, dtype=torch.float32)
    state["model.layers.2.self_attn.rotary_emb.inv_freq"] = torch.arange(32, dtype=torch.float32)
    state["score.weight"] = torch.randn(3, 256)
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=2)
    keys = [key for key, _ in received(weightstream.iter_layers(uri))]
    assert sorted(keys[:2]) == ["model.embed_tokens", "model.rotary_emb"]
    assert keys[2 : 2 + SHAPE.layers] == [f"model.layers.{n}" for n in range(SHAPE.layers)]
    assert sorted(keys[2 + SHAPE.layers :]) == ["model.norm", "score"]
    assert "lm_head" not in keys
    assert_same(weightstream.load_weights(uri, format="layered"), state)


def test_moe_experts_stay_in_their_layer(tmp_path: Path, no_leaks):
    state = {"model.embed_tokens.weight": torch.randn(50, 16)}
    for layer in range(12):  # two-digit layer numbers sort as numbers, not strings
        state[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = torch.randn(4, 16)
        for expert in range(4):
            for proj in ("w1", "w2", "w3"):
                state[f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight"] = torch.randn(8, 16)
        state[f"model.layers.{layer}.mlp.shared_expert.up_proj.weight"] = torch.randn(8, 16)
    state["model.norm.weight"] = torch.randn(16)
    state["lm_head.weight"] = torch.randn(50, 16)
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=3)
    layers = received(weightstream.iter_layers(uri))
    assert [key for key, _ in layers] == [
        "model.embed_tokens",
        *(f"model.layers.{n}" for n in range(12)),
        "model.norm",
        "lm_head",
    ]
    for key, names in layers[1:-2]:
        assert len(names) == 1 + 4 * 3 + 1 and all(name.startswith(key + ".") for name in names)


def test_a_regex_rule_groups_other_namings(tmp_path: Path, no_leaks):
    state = {"transformer.wte.weight": torch.randn(20, 8), "transformer.ln_f.weight": torch.randn(8)}
    for block in range(3):
        state[f"transformer.h.{block}.attn.c_attn.weight"] = torch.randn(8, 24)
        state[f"transformer.h.{block}.ln_1.weight"] = torch.randn(8)
    uri = save_hf_sharded(state, tmp_path / "ckpt", shards=1)
    layers = received(weightstream.iter_layers(uri, layer_rule=r"\bh\.(\d+)\."))
    assert [key for key, _ in layers] == [
        "transformer.wte",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.h.2",
        "transformer.ln_f",
    ]


def test_a_callable_rule_names_the_layers(tmp_path: Path, no_leaks):
    state, uri = llama(tmp_path)

    def pairs(name: str) -> str:  # two Llama layers per group
        parts = name.split(".")
        return f"pair.{int(parts[2]) // 2}" if parts[1] == "layers" else "rest"

    layers = received(weightstream.iter_layers(uri, layer_rule=pairs))
    assert [key for key, _ in layers] == ["pair.0", "pair.1", "pair.2", "rest"]
    assert layers[0][1] == sorted(n for n in state if n.startswith(("model.layers.0.", "model.layers.1.")))


@pytest.mark.parametrize(
    ("rule", "error", "message"),
    [
        (r"layers\.[0-9]+\.", weightstream.InvalidOptionError, r"needs a group capturing the layer number"),
        (r"layers\.(\d+", weightstream.InvalidOptionError, r"is not a regular expression"),
        (
            r"model\.(\w+)\.",
            weightstream.InvalidOptionError,
            r"captured 'embed_tokens' from tensor 'model.embed_tokens.weight': not a layer number",
        ),
        (
            lambda name: 3,
            weightstream.OptionError,
            r"layer_rule returned int for tensor '.*'; it must return the layer's key",
        ),
        (lambda name: "", weightstream.InvalidOptionError, r"layer_rule returned an empty key for tensor"),
        (42, weightstream.OptionError, r"layer_rule must be a regular expression or a callable"),
    ],
)
def test_a_bad_rule_is_refused_before_any_read(tmp_path: Path, rule, error, message, no_leaks):
    _, uri = llama(tmp_path)
    reads = []
    with pytest.raises(error, match=message):
        weightstream.iter_layers(uri, layer_rule=rule, progress=reads.append)
    assert reads == []


# Reused buffers and the release contract


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_buffers_are_reused_layer_after_layer(tmp_path: Path, prefetch, no_leaks):
    _, uri = llama(tmp_path)
    bases = [
        next(iter(tensors.values())).untyped_storage().data_ptr()
        for _, tensors in weightstream.iter_layers(uri, prefetch_layers=prefetch)
    ]
    assert len(bases) == SHAPE.layers + 3
    assert len(set(bases)) == prefetch + 1, "prefetch_layers + 1 buffers, allocated once and reused"


@pytest.mark.parametrize("prefetch", [1, 2])
def test_layers_ahead_are_read_while_the_caller_works_and_no_further(tmp_path: Path, prefetch, no_leaks):
    state, uri = llama(tmp_path)
    read, lock = [0], threading.Lock()

    def count(nbytes: int) -> None:
        with lock:
            read[0] += nbytes

    sizes = [
        sum(state[name].numel() * state[name].element_size() for name in names)
        for _, names in expected_layers(state, SHAPE.layers)
    ]
    for number, (_, tensors) in enumerate(
        weightstream.iter_layers(uri, prefetch_layers=prefetch, chunk_bytes=64 * 1024, progress=count)
    ):
        ahead = sum(sizes[: number + prefetch + 1])  # this layer and the prefetched ones
        deadline = time.monotonic() + 10
        while read[0] < ahead and time.monotonic() < deadline:
            time.sleep(0.005)  # the caller "works" on this layer while the next ones are read
        with lock:
            assert read[0] == ahead, f"holding layer {number}: {read[0]} bytes read, {ahead} expected"
        del tensors


@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_caller_may_hold_prefetch_layers_when_asking_for_the_next(tmp_path: Path, prefetch, no_leaks):
    state, uri = llama(tmp_path)
    kept: list[dict[str, torch.Tensor]] = []
    for _, tensors in weightstream.iter_layers(uri, prefetch_layers=prefetch):
        kept.append(tensors)
        del tensors
        if len(kept) > prefetch - 1:
            for name, tensor in kept[0].items():  # still intact when the layers after it are read
                assert torch.equal(tensor.view(torch.uint8), state[name].view(torch.uint8))
            kept.pop(0)


def test_holding_one_layer_too_many_raises_naming_them_and_overwrites_nothing(tmp_path: Path, no_leaks):
    state, uri = llama(tmp_path)
    layers = weightstream.iter_layers(uri, prefetch_layers=1)
    _, embeddings = next(layers)
    _, first = next(layers)
    view_of_first = first["model.layers.0.mlp.up_proj.weight"][1:3]  # a view is as good as the tensor
    del first
    with pytest.raises(
        weightstream.LayerInUseError,
        match=r"layer 'model.layers.1' needs one of the 2 buffers of prefetch_layers=1, but tensors of "
        r"'model.embed_tokens', 'model.layers.0' are still referenced.*copy_layers=True",
    ):
        next(layers)
    assert torch.equal(view_of_first, state["model.layers.0.mlp.up_proj.weight"][1:3])
    assert_same(embeddings, {"model.embed_tokens.weight": state["model.embed_tokens.weight"]})


def test_a_layer_is_released_when_its_last_view_dies(tmp_path: Path, no_leaks):
    state, uri = llama(tmp_path)
    layers = weightstream.iter_layers(uri, prefetch_layers=1)

    def base(tensors: dict[str, torch.Tensor]) -> int:
        return next(iter(tensors.values())).untyped_storage().data_ptr()

    _, embeddings = next(layers)
    first_buffer = base(embeddings)
    survivor = embeddings["model.embed_tokens.weight"].view(-1)[:10]  # keeps the embeddings' buffer
    del embeddings
    bases = []
    for _ in range(3):
        _, tensors = next(layers)
        bases.append(base(tensors))
        del tensors
    assert first_buffer not in bases, "a buffer was refilled while a view of its layer was alive"
    assert torch.equal(survivor, state["model.embed_tokens.weight"].view(-1)[:10])
    del survivor  # the last view: the buffer comes back
    rest = [base(tensors) for _, tensors in layers]
    assert first_buffer in rest


def test_reference_cycles_are_collected_before_refusing(tmp_path: Path, no_leaks):
    _, uri = llama(tmp_path)
    count = 0
    for _, tensors in weightstream.iter_layers(uri, prefetch_layers=1):
        cycle = {"tensors": tensors}
        cycle["self"] = cycle  # only the garbage collector frees this layer
        del cycle, tensors
        count += 1
    assert count == SHAPE.layers + 3


def test_copies_can_all_be_kept(tmp_path: Path, no_leaks):
    state, uri = llama(tmp_path)
    kept = list(weightstream.iter_layers(uri, copy_layers=True))
    assert_same({name: tensor for _, tensors in kept for name, tensor in tensors.items()}, state)
    storages = {next(iter(tensors.values())).untyped_storage().data_ptr() for _, tensors in kept}
    assert len(storages) == len(kept), "each layer's copy is memory of its own"


def test_load_weights_receives_copies(tmp_path: Path, no_leaks):
    state, uri = llama(tmp_path)
    loaded = weightstream.load_weights(uri, format="layered")
    assert_same(loaded, state)
    assert list(loaded) == [spec.name for spec in weightstream.open(uri).plan.tensors], "stored order, as every loader"


# The hook


def test_the_hook_sees_each_complete_layer_in_order_before_it_is_yielded(tmp_path: Path, no_leaks):
    state, uri = llama(tmp_path)
    events = []

    def hook(key: str, tensors: dict[str, torch.Tensor]) -> None:
        assert_same(tensors, {name: state[name] for name in tensors})  # complete: every byte landed
        events.append(("hook", key, sorted(tensors)))

    for key, tensors in weightstream.iter_layers(uri, layer_hook=hook):
        events.append(("yield", key, sorted(tensors)))
    expected = expected_layers(state, SHAPE.layers)
    assert events == [(kind, key, names) for key, names in expected for kind in ("hook", "yield")]


def test_a_quantizing_hook_frees_the_buffer_so_its_results_can_all_be_kept(tmp_path: Path, no_leaks):
    state, uri = llama(tmp_path)

    def quantize(key: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        result = {}
        for name, tensor in tensors.items():
            scale = tensor.float().abs().amax().clamp(min=1e-8) / 127
            result[name] = (tensor.float() / scale).round().to(torch.int8)
            result[name + "_scale"] = scale
        return result

    kept = dict(layer for layer in weightstream.iter_layers(uri, layer_hook=quantize, prefetch_layers=1))
    assert len(kept) == SHAPE.layers + 3
    up = kept["model.layers.3"]["model.layers.3.mlp.up_proj.weight"]
    assert up.dtype == torch.int8
    scale = kept["model.layers.3"]["model.layers.3.mlp.up_proj.weight_scale"]
    assert torch.allclose(up.float() * scale, state["model.layers.3.mlp.up_proj.weight"].float(), atol=float(scale))


def test_load_weights_returns_what_the_hook_returns(tmp_path: Path, no_leaks):
    state, uri = llama(tmp_path)

    def quantize_and_rename(key: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        result = {}
        for name, tensor in tensors.items():
            result[name.replace("model.", "decoder.", 1)] = tensor.clone()
            result[name + "_scale"] = torch.ones(())
        return result

    loaded = weightstream.load_weights(uri, format="layered", layer_hook=quantize_and_rename)
    assert sorted(loaded) == sorted(
        [name.replace("model.", "decoder.", 1) for name in state] + [name + "_scale" for name in state]
    )
    assert torch.equal(loaded["decoder.layers.1.mlp.up_proj.weight"], state["model.layers.1.mlp.up_proj.weight"])


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ([1, 2], r"layer_hook returned list for layer 'model.embed_tokens'; it must return a mapping"),
        ({"w": 1}, r"returned str -> int for layer"),
    ],
)
def test_a_hook_returning_something_else_is_a_typed_error(tmp_path: Path, result, message, no_leaks):
    _, uri = llama(tmp_path)
    with pytest.raises(weightstream.OptionError, match=message):
        received(weightstream.iter_layers(uri, layer_hook=lambda key, tensors: result))


def test_a_failing_hook_stops_the_load_and_leaks_nothing(tmp_path: Path, no_leaks):
    _, uri = llama(tmp_path)

    def hook(key: str, tensors: dict[str, torch.Tensor]) -> None:
        if key == "model.layers.2":
            raise ArithmeticError("quantization diverged")

    with pytest.raises(ArithmeticError, match="quantization diverged"):
        received(weightstream.iter_layers(uri, layer_hook=hook))


# Abandonment and failures


def test_abandoning_the_layers_stops_everything_and_frees_the_buffers(tmp_path: Path, no_leaks):
    state, uri = llama(
        tmp_path, shape=LlamaShape(hidden=1024, intermediate=2816, layers=6, vocab=8000)
    )  # 24 MiB layers
    baseline = psutil.Process().memory_info().rss
    layers = weightstream.iter_layers(uri, prefetch_layers=3)
    _, embeddings = next(layers)
    _, first = next(layers)
    layers.close()
    assert torch.equal(first["model.layers.0.mlp.down_proj.weight"], state["model.layers.0.mlp.down_proj.weight"]), (
        "held layers stay valid"
    )
    del embeddings, first, layers
    gc.collect()
    assert psutil.Process().memory_info().rss - baseline < 24 * MIB, "the buffers outlived the abandoned load"


def test_abandoning_while_a_layer_is_being_read(tmp_path: Path, no_leaks):
    _, uri = llama(tmp_path)
    reading = threading.Event()
    release = threading.Event()

    def slow(nbytes: int) -> None:
        reading.set()
        release.wait(5)

    layers = weightstream.iter_layers(uri, chunk_bytes=64 * 1024, threads=2, progress=slow)
    closer = threading.Timer(0.2, release.set)
    closer.start()
    next(layers)
    layers.close()
    closer.join()
    assert reading.is_set()


def test_a_file_truncated_mid_load_is_a_typed_error_and_leaks_nothing(tmp_path: Path, no_leaks):
    _, uri = llama(tmp_path, shards=2)
    truncate = truncating_after_first_read(sorted(Path(uri).glob("*.safetensors")))
    with pytest.raises(weightstream.TruncatedFileError, match=r"file ends at byte \d+, expected bytes up to \d+"):
        received(weightstream.iter_layers(uri, chunk_bytes=64 * 1024, progress=truncate))


# Options


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"prefetch_layers": 0}, weightstream.InvalidOptionError, r"prefetch_layers must be a positive integer, got 0"),
        ({"layer_hook": "quantize"}, weightstream.OptionError, r"layer_hook must be callable, got str"),
        ({"copy_layers": 1}, weightstream.OptionError, r"copy_layers must be a bool, got int"),
        ({"zero_copy": True}, weightstream.InvalidOptionError, r"zero_copy=True: maps whole files"),
        (
            {"max_inflight_bytes": 64 * MIB},
            weightstream.InvalidOptionError,
            r"max_inflight_bytes: an option of format='streaming'; the layered loader does not use it",
        ),
        (
            {"device": "cuda", "gds": True},
            weightstream.InvalidOptionError,
            r"gds=True: format='layered' reaches a GPU through the pinned staging ring, not cuFile",
        ),
    ],
)
def test_options_the_layered_loader_refuses(tmp_path: Path, options, error, message, no_leaks):
    _, uri = llama(tmp_path)
    with pytest.raises(error, match=message):
        weightstream.iter_layers(uri, **options)


@pytest.mark.parametrize("loader", ["safetensors", "streaming"])
@pytest.mark.parametrize(
    "option", [{"prefetch_layers": 2}, {"layer_rule": r"h\.(\d+)"}, {"layer_hook": print}, {"copy_layers": True}]
)
def test_other_loaders_refuse_the_layered_options(tmp_path: Path, loader, option, no_leaks):
    _, uri = llama(tmp_path)
    with pytest.raises(
        weightstream.InvalidOptionError,
        match=rf"{next(iter(option))}: an option of format='layered'; the {loader} loader does not use it",
    ):
        weightstream.iter_weights(uri, format=loader, **option)


# Sources and destinations


@pytest.mark.slow
def test_layers_from_object_stores(scheme, tmp_path: Path, no_leaks):
    state, local = llama(tmp_path, shards=2)
    uri = upload(scheme, Path(local), "layered")
    seen = []
    for key, tensors in weightstream.iter_layers(uri, chunk_bytes=MIB, prefetch_layers=2):
        assert_same(tensors, {name: state[name] for name in tensors})
        seen.append((key, sorted(tensors)))
    assert seen == expected_layers(state, SHAPE.layers)


@pytest.mark.slow
def test_layers_over_http(http_base, tmp_path: Path, no_leaks):
    state, local = llama(tmp_path, shards=2)
    uri = upload("s3", Path(local), "layered-http").replace("s3://bench", http_base)
    assert_same(weightstream.load_weights(uri, format="layered"), state)


@pytest.mark.parametrize("direct_io", [False, True])
def test_the_staged_path_reuses_device_buffers_and_yields_only_finished_copies(tmp_path: Path, direct_io, no_leaks):
    """What a GPU load does, with the CPU copy engine and random copy delays."""
    state, uri = llama(tmp_path, shards=2)
    engines: list[DelayedCheckingEngine] = []

    def engine() -> DelayedCheckingEngine:
        engines.append(DelayedCheckingEngine(seed=3))
        return engines[-1]

    with weightstream.open(
        uri, "layered", direct_io=direct_io, staging_slots=3, staging_slot_bytes=64 * 1024, threads=4
    ) as checkpoint:
        plan, opts = checkpoint.plan, checkpoint.options
    bases, keys = set(), []
    for key, tensors in read_layers(
        store_for(uri), plan, group_layers(plan.tensors), opts, LayerReading(), pinned=False, staging=CpuStaging(engine)
    ):
        assert_same(tensors, {name: state[name] for name in tensors})  # every copy finished before the yield
        bases.add(next(iter(tensors.values())).untyped_storage().data_ptr())
        keys.append(key)
    assert keys == [key for key, _ in expected_layers(state, SHAPE.layers)]
    assert len(bases) == 2
    assert engines[0].violations == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_layers_with_a_kernel_still_reading_the_previous_layer(tmp_path: Path, no_leaks):
    """Work the caller queued on a released layer finishes before its buffer is refilled."""
    state, uri = llama(tmp_path)
    totals = []
    for _, tensors in weightstream.iter_layers(uri, device="cuda", prefetch_layers=1):
        totals.append(sum(t.double().sum() for t in tensors.values()))  # queued on the current stream
        del tensors
    expected = [sum(state[n].double().sum() for n in names) for _, names in expected_layers(state, SHAPE.layers)]
    assert [float(total) for total in totals] == pytest.approx([float(e) for e in expected])


# The memory envelope


@pytest.fixture(scope="module")
def two_gib_sixteen_layers(tmp_path_factory) -> str:
    shape = LlamaShape.of_size(2 << 30, layers=16)
    directory = tmp_path_factory.mktemp("layered-2gib")
    state = {
        name: torch.full(dims, 0.5, dtype=torch.bfloat16) for name, dims in shape.tensor_shapes()
    }  # contents do not matter here
    write_sharded(state, directory, shards=2)
    return str(directory)


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [1, 2])
def test_peak_rss_of_a_2gib_16_layer_checkpoint_stays_within_prefetch_plus_two_layers(two_gib_sixteen_layers, prefetch):
    result = subprocess.run(
        [sys.executable, "-m", "tests.layered_envelope", two_gib_sixteen_layers, str(prefetch)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parent.parent,
        env=os.environ.copy(),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout)
    assert measured["layers"] == 16 + 3 and measured["bytes"] > 1.9 * (1 << 30)
    bound = (prefetch + 2) * measured["largest_layer"]
    assert measured["peak_above_baseline"] <= bound, f"{measured} exceeds (prefetch + 2) x the largest layer = {bound}"
    assert measured["peak_above_baseline"] < measured["bytes"] / 4
