"""A tiny random Llama that vLLM's CPU backend runs: ``python -m tests.engine_model DIR [SEED]``.

Run with an engine's interpreter (it needs ``transformers``). 2-D weights are re-drawn from
``normal(0, 0.2)`` so that greedy decoding is not degenerate (the same token over and over).
"""

from __future__ import annotations

import sys


def make_tiny_llama(directory: str, seed: int = 0) -> None:
    """Save the model (``config.json`` and safetensors, float32) to ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2)
    model.save_pretrained(directory, safe_serialization=True)


if __name__ == "__main__":
    make_tiny_llama(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
