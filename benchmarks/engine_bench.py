"""What the engine benchmarks (``vllm_bench.py``, ``sglang_bench.py``) share: the model, the
interleaved rounds (cold and warm page cache, method order rotated each round) and the summary.

The model: a random bf16 Llama of 12 layers, hidden 2048 (1.34 GB, two shards), written once to
``~/.cache/weightstream/demo-vllm-llama-12l-2048h`` with a Hugging Face ``config.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))

from weightstream.bench.demo import LlamaShape, llama_state_dict, write_sharded
from weightstream.bench.runner import prepare_cache

SHAPE = LlamaShape(layers=12)
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}


def model_directory() -> Path:
    """The benchmark's model, written on first use."""
    directory = Path.home() / ".cache" / "weightstream" / "demo-vllm-llama-12l-2048h"
    if not (directory / "config.json").exists():
        write_sharded(llama_state_dict(SHAPE, torch.bfloat16, seed=0), directory, shards=2)
        (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory


def interleaved_rounds(
    methods: list[str], rounds: int, files: list[str], run: Callable[[str], float]
) -> dict[str, dict[str, list[float]]]:
    """``run(method)`` seconds, per cache and method: each round cold then warm, the method order rotated."""
    runs: dict[str, dict[str, list[float]]] = {cache: {method: [] for method in methods} for cache in ("cold", "warm")}
    for round_number in range(rounds):
        for cache in ("cold", "warm"):
            for method in methods[round_number % len(methods) :] + methods[: round_number % len(methods)]:
                prepare_cache(files, cache)
                runs[cache][method].append(run(method))
                print(f"round {round_number + 1} {cache} {method:24s} {runs[cache][method][-1]:.2f} s", file=sys.stderr)
    return runs


def summarise(runs: dict[str, dict[str, list[float]]], reference: str) -> list[dict]:
    """Medians and each method's ratio to ``reference``'s median, printed and returned."""
    summary = []
    for cache, by_method in runs.items():
        base = statistics.median(by_method[reference]) if reference in by_method else None
        for method, seconds in by_method.items():
            median = statistics.median(seconds)
            ratio = median / base if base else None
            summary.append(
                {
                    "cache": cache,
                    "method": method,
                    "seconds_median": median,
                    "seconds": seconds,
                    f"x_{reference}": ratio,
                }
            )
            print(
                f"{cache:5s} {method:24s} {median:6.2f} s  ({', '.join(f'{s:.2f}' for s in seconds)})"
                + (f"  {ratio:.2f}x {reference}" if ratio else "")
            )
    return summary
