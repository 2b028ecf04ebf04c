"""Greedy tokens from a real vLLM: ``python -m tests.vllm_generate CASES_JSON``.

Run with the vLLM test environment's interpreter. ``CASES_JSON`` is a list of cases, run in order
in this one process (one engine at a time): ``{"model": DIR, "load_format": NAME, "extra": {...}}``,
optionally ``"save_sharded": DIR`` (save the loaded model with ``weightstream.engines.vllm``'s
helper), ``"cold": true`` (the model's files dropped from the page cache first) and ``"tp": N``
(N tensor-parallel worker processes; the CPU backend needs ``VLLM_CPU_OMP_THREADS_BIND`` then). Run with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: each engine in this process. Prints one JSON line: a result
per case, ``{"tokens": [[...], ...], "said": [...]}`` (what the adapters logged) or ``{"error": [type, message]}``.
"""

from __future__ import annotations

import gc
import json
import sys

from tests.engine_run import adapters_said, make_cold

PROMPTS = [[1, 17, 42, 300], [5, 6, 7], [511, 2, 99, 100, 250, 8]]


def run(case: dict) -> dict:
    if case.get("cold"):
        make_cold(case["model"])
    with adapters_said() as said:
        return generate(case) | {"said": said}


def generate(case: dict) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    try:
        parallel = (
            {"tensor_parallel_size": case["tp"], "distributed_executor_backend": "mp"} if case.get("tp", 1) > 1 else {}
        )
        llm = LLM(
            model=case["model"],
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            max_model_len=128,
            max_num_seqs=4,
            seed=0,
            kv_cache_memory_bytes=64 << 20,
            load_format=case["load_format"],
            model_loader_extra_config=case.get("extra") or {},
            **parallel,
        )
    except Exception as error:  # noqa: BLE001 - the test asserts on it
        root = error
        while root.__cause__ is not None:
            root = root.__cause__
        return {"error": [type(root).__name__, str(root)], "outer": [type(error).__name__, str(error)]}
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in PROMPTS], params, use_tqdm=False)
        result: dict = {"tokens": [list(output.outputs[0].token_ids) for output in outputs]}
        if case.get("save_sharded"):
            from weightstream.engines.vllm import save_sharded_state

            try:
                save_sharded_state(llm, case["save_sharded"])
            except Exception as error:  # noqa: BLE001 - the test asserts on it
                result["save_error"] = [type(error).__name__, str(error)]
        return result
    finally:
        del llm
        gc.collect()


if __name__ == "__main__":
    print(json.dumps([run(case) for case in json.loads(sys.argv[1])]), flush=True)
