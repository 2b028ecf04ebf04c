"""A tiny random Llama that vLLM's CPU backend runs: ``python -m tests.engine_model DIR [SEED]``.

Run with an engine's interpreter (it needs ``transformers``). 2-D weights are re-drawn from
``normal(0, 0.2)`` so that greedy decoding is not degenerate (the same token over and over).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path


def make_tiny_llama(directory: str, seed: int = 0) -> None:
    """Save the model (``config.json`` and safetensors, float32) to ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2)
    model.save_pretrained(directory, safe_serialization=True)


def variant(model: Path, directory: Path, change: Callable[[dict], dict]) -> Path:
    """A copy of ``model`` whose tensors went through ``change(dict) -> dict`` (runs in the tests' environment)."""
    from safetensors.torch import load_file, save_file

    directory.mkdir()
    for path in model.iterdir():
        if path.suffix == ".json":
            shutil.copy(path, directory / path.name)
    save_file(
        change(load_file(model / "model.safetensors")), directory / "model.safetensors", metadata={"format": "pt"}
    )
    return directory


def altered(state: dict) -> dict:
    """One tensor negated: a negative control that must change what the engine computes."""
    state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"] * -1
    return state


def without_head(state: dict) -> dict:
    del state["lm_head.weight"]
    return state


def without_v_proj(state: dict) -> dict:
    """Layer 0's ``v_proj`` gone: a third of the engine's fused ``qkv_proj`` never written."""
    del state["model.layers.0.self_attn.v_proj.weight"]
    return state


if __name__ == "__main__":
    make_tiny_llama(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
