"""Converting a Hugging Face Llama checkpoint into a tensor-parallel sharded state: the ranks
re-assemble into the source bit for bit; rules, refusals, and the CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import weightstream
from tests.conftest import save_hf_sharded
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.save.convert import LLAMA_RULES, convert_to_sharded_state, parse_rule, split_dimension

SHAPE = LlamaShape(hidden=256, intermediate=768, layers=2, vocab=1024)
ROOT = Path(__file__).parent.parent


def reassembled(directory: Path, tp: int, rules=LLAMA_RULES) -> dict[str, torch.Tensor]:
    """Every tensor put back together from the ranks' files (checked against their manifests)."""
    ranks = [
        weightstream.load_weights(directory, format="sharded-state", rank=rank, world_size=tp, verify=True)
        for rank in range(tp)
    ]
    whole = {}
    for name, first in ranks[0].items():
        dimension = split_dimension(name, first.shape, 1, rules)
        if dimension is None:
            assert all(torch.equal(rank[name].view(torch.uint8), first.view(torch.uint8)) for rank in ranks), (
                f"{name} differs between ranks"
            )
            whole[name] = first
        else:
            whole[name] = torch.cat([rank[name] for rank in ranks], dimension)
    return whole


def same_bits(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return loaded.keys() == expected.keys() and all(
        loaded[n].shape == expected[n].shape
        and loaded[n].dtype == expected[n].dtype
        and torch.equal(
            loaded[n].contiguous().view(-1).view(torch.uint8), expected[n].contiguous().view(-1).view(torch.uint8)
        )
        for n in expected
    )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_ranks_reassemble_into_the_source_bit_for_bit(tmp_path: Path, tp, no_leaks):
    state = llama_state_dict(SHAPE, seed=tp)
    for layer in range(SHAPE.layers):  # Qwen-style attention biases, and a rotary buffer
        for projection in ("q_proj", "k_proj", "v_proj"):
            rows = state[f"model.layers.{layer}.self_attn.{projection}.weight"].shape[0]
            state[f"model.layers.{layer}.self_attn.{projection}.bias"] = torch.randn(rows).to(torch.bfloat16)
        state[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.arange(32, dtype=torch.float32)
    source = save_hf_sharded(state, tmp_path / "hf", shards=2)
    result = convert_to_sharded_state(source, tmp_path / "tp", tp=tp, max_file_bytes=1 << 20)
    assert same_bits(reassembled(tmp_path / "tp", tp), state)
    assert result["split"]["model.layers.0.self_attn.o_proj.weight"] == 1 and result["split"]["lm_head.weight"] == 0
    assert result["split"]["model.norm.weight"] is None
    rank_zero = weightstream.load_weights(tmp_path / "tp", format="sharded-state", rank=0, world_size=tp)
    assert rank_zero["model.layers.1.mlp.down_proj.weight"].shape == (SHAPE.hidden, SHAPE.intermediate // tp)
    assert rank_zero["model.embed_tokens.weight"].shape == (SHAPE.vocab // tp, SHAPE.hidden)


def test_tied_embeddings_and_a_rule_for_moe_experts(tmp_path: Path, no_leaks):
    state = llama_state_dict(SHAPE)
    del state["lm_head.weight"]
    state["model.layers.0.block_sparse_moe.experts.0.w1.weight"] = torch.randn(64, 256)
    state["model.layers.0.block_sparse_moe.gate.weight"] = torch.randn(4, 256)
    source = save_hf_sharded(state, tmp_path / "hf", shards=1)
    with pytest.raises(
        weightstream.InvalidOptionError,
        match=r"tensor 'model.layers.0.block_sparse_moe.experts.0.w1.weight' matches no split rule",
    ):
        convert_to_sharded_state(source, tmp_path / "tp", tp=2)
    assert not (tmp_path / "tp").exists(), "a refused conversion writes nothing"
    rules = [parse_rule(r"experts\.\d+\.w1\.weight$=0"), parse_rule(r"moe\.gate\.weight$=replicate"), *LLAMA_RULES]
    convert_to_sharded_state(source, tmp_path / "tp", tp=2, rules=rules)
    assert same_bits(reassembled(tmp_path / "tp", 2, rules), state)


def test_a_dimension_that_does_not_divide_is_refused(tmp_path: Path, no_leaks):
    state = llama_state_dict(LlamaShape(hidden=256, intermediate=768, layers=1, vocab=1001))
    source = save_hf_sharded(state, tmp_path / "hf", shards=1)
    with pytest.raises(
        weightstream.InvalidOptionError,
        match=r"tensor '(lm_head|model.embed_tokens).weight' of shape \(1001, 256\): dimension 0 \(1001\) does not "
        r"divide by tp=2",
    ):
        convert_to_sharded_state(source, tmp_path / "tp", tp=2)
    assert not (tmp_path / "tp").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("q_proj", r"a rule is PATTERN=DIM or PATTERN=replicate"),
        ("q_proj=two", r"'two' is neither a dimension nor 'replicate'"),
        ("q_proj(=0", r"is not a regular expression"),
    ],
)
def test_bad_rules(text, message):
    with pytest.raises(weightstream.InvalidOptionError, match=message):
        parse_rule(text)


def test_the_cli_converts_and_reports(tmp_path: Path):
    state = llama_state_dict(SHAPE)
    source = save_hf_sharded(state, tmp_path / "hf", shards=2)
    command = [
        sys.executable,
        "-m",
        "weightstream.cli",
        "convert",
        str(source),
        str(tmp_path / "tp"),
        "--to",
        "sharded-state",
        "--tp",
        "2",
        "--max-file-mib",
        "1",
        "--json",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tp"] == 2 and "model.norm.weight" in report["replicated"]
    assert sorted(Path(path).name for path in report["files"]) == sorted(
        p.name for p in (tmp_path / "tp").glob("model-rank-*-part-*.safetensors")
    )
    assert same_bits(reassembled(tmp_path / "tp", 2), state)
    refused = subprocess.run(
        [*command[:6], "--to", "layered", "--tp", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert refused.returncode == 2 and "argument --to: invalid choice: 'layered'" in refused.stderr
    for rank in ("0", "1"):
        loaded = subprocess.run(
            [
                *command[:3],
                "load",
                str(tmp_path / "tp"),
                "--format",
                "sharded-state",
                "--rank",
                rank,
                "--world-size",
                "2",
                "--json",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
            check=False,
        )
        assert loaded.returncode == 0, loaded.stderr
        assert json.loads(loaded.stdout)["tensors"] == len(state)
    not_a_rank = subprocess.run(
        [*command[:3], "inspect", str(tmp_path / "tp"), "--rank", "one"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert not_a_rank.returncode == 2 and "not a rank: 'one' (N, or PP,TP with pipeline parallelism)" in (
        not_a_rank.stderr
    )


def write_config(directory: Path, heads: int, kv_heads: int) -> None:
    (directory / "config.json").write_text(json.dumps({"num_attention_heads": heads, "num_key_value_heads": kv_heads}))


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_naming_fuses_projections_and_pads_the_vocabulary(tmp_path: Path, tp, no_leaks):
    shape = LlamaShape(hidden=128, intermediate=256, layers=2, vocab=500)
    state = llama_state_dict(shape, seed=3)
    source = save_hf_sharded(state, tmp_path / "hf", shards=2)
    write_config(source, heads=4, kv_heads=2)
    result = convert_to_sharded_state(source, tmp_path / "tp", tp=tp, engine="vllm")
    assert result["engine"] == "vllm"
    padded = 512  # 500 rows padded to a multiple of 64
    for rank in range(tp):
        loaded = weightstream.load_weights(tmp_path / "tp", format="sharded-state", rank=rank, world_size=tp)
        assert not [name for name in loaded if re.search(r"\.(q|k|v|gate|up)_proj\.", name)]
        for layer in range(shape.layers):
            prefix = f"model.layers.{layer}."
            parts = [state[f"{prefix}self_attn.{p}_proj.weight"].chunk(tp)[rank] for p in ("q", "k", "v")]
            assert torch.equal(loaded[f"{prefix}self_attn.qkv_proj.weight"], torch.cat(parts))
            parts = [state[f"{prefix}mlp.{p}_proj.weight"].chunk(tp)[rank] for p in ("gate", "up")]
            assert torch.equal(loaded[f"{prefix}mlp.gate_up_proj.weight"], torch.cat(parts))
            assert torch.equal(
                loaded[f"{prefix}self_attn.o_proj.weight"],
                state[f"{prefix}self_attn.o_proj.weight"].chunk(tp, dim=1)[rank],
            )
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = padded // tp
            full = torch.cat([state[name], torch.zeros(padded - 500, shape.hidden, dtype=state[name].dtype)])
            assert torch.equal(loaded[name], full[rank * rows : (rank + 1) * rows])
        assert torch.equal(loaded["model.norm.weight"], state["model.norm.weight"])


def test_engine_naming_needs_heads_that_divide(tmp_path: Path, no_leaks):
    state = llama_state_dict(LlamaShape(hidden=128, intermediate=256, layers=1, vocab=512))
    source = save_hf_sharded(state, tmp_path / "hf", shards=1)
    with pytest.raises(
        weightstream.InvalidOptionError, match=r"--engine needs the model's config.json beside the checkpoint"
    ):
        convert_to_sharded_state(source, tmp_path / "tp", tp=2, engine="sglang")
    write_config(source, heads=4, kv_heads=1)
    with pytest.raises(
        weightstream.InvalidOptionError,
        match=r"config.json: 1 key-value heads do not divide by tp=2 \(the engines would replicate them",
    ):
        convert_to_sharded_state(source, tmp_path / "tp", tp=2, engine="sglang")
    with pytest.raises(weightstream.InvalidOptionError, match=r"engine must be one of vllm, sglang"):
        convert_to_sharded_state(source, tmp_path / "tp", tp=1, engine="trt")
    assert not (tmp_path / "tp").exists()


def test_a_fused_parameter_missing_a_part_is_refused_before_writing(tmp_path: Path, no_leaks):
    state = llama_state_dict(LlamaShape(hidden=128, intermediate=256, layers=1, vocab=512))
    del state["model.layers.0.self_attn.v_proj.weight"]
    source = save_hf_sharded(state, tmp_path / "hf", shards=1)
    write_config(source, heads=4, kv_heads=2)
    with pytest.raises(
        weightstream.InvalidOptionError,
        match=r"model.layers.0.self_attn.qkv_proj.weight fuses q_proj, k_proj, v_proj, "
        r"but the checkpoint has no v_proj",
    ):
        convert_to_sharded_state(source, tmp_path / "tp", tp=2, engine="vllm")
    assert not (tmp_path / "tp").exists()


def test_conversion_carries_the_config_and_tokenizer_and_stays_outside_its_source(tmp_path: Path, no_leaks):
    state = llama_state_dict(SHAPE)
    source = save_hf_sharded(state, tmp_path / "hf", shards=2)
    (source / "config.json").write_text('{"num_attention_heads": 4}')
    (source / "tokenizer.json").write_text('{"model": {}}')
    (source / "pytorch_model.bin").write_bytes(b"never copied")
    result = convert_to_sharded_state(source, tmp_path / "tp", tp=2)
    assert result["copied"] == ["config.json", "tokenizer.json"]
    assert (tmp_path / "tp" / "config.json").read_text() == '{"num_attention_heads": 4}'
    assert not (tmp_path / "tp" / "pytorch_model.bin").exists()
    assert not list((tmp_path / "tp").glob(".*.partial"))
    for destination in (source, source / "tp2", source / "model.safetensors.index.json" / ".."):
        with pytest.raises(weightstream.InvalidOptionError, match=r"is inside the checkpoint being converted"):
            convert_to_sharded_state(source, destination, tp=2)
    assert not (source / "tp2").exists()


def test_auto_reads_a_converted_checkpoint_as_a_sharded_state(tmp_path: Path, no_leaks):
    state = llama_state_dict(SHAPE)
    source = save_hf_sharded(state, tmp_path / "hf", shards=2)
    convert_to_sharded_state(source, tmp_path / "tp", tp=2)
    with weightstream.open(tmp_path / "tp", rank=1, world_size=2) as checkpoint:
        assert checkpoint.format == "sharded-state"
        loaded = checkpoint.load()
    assert set(loaded) == set(state)
    with pytest.raises(weightstream.ManifestError, match=r"saved for a world size of 2"):
        weightstream.load_weights(tmp_path / "tp", rank=0, world_size=1)
