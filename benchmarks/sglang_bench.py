"""SGLang's model loading with weightstream's load formats against SGLang's own ``auto`` (its
multi-threaded safetensors loader), on the CPU, cold and warm page cache, rounds interleaved.

    python benchmarks/sglang_bench.py --rounds 3 --json sglang-1.3gb.json

No SGLang engine runs on a CPU: each run is a fresh process of the tests' SGLang environment
(``tests/engine_envs.py``, the real ``sglang`` package) that builds SGLang's own ``LlamaForCausalLM``
on the CPU through ``get_model_loader(...).load_model(...)``, as SGLang's model runner does, and
times that call (the model's construction included, the same for every method; SGLang's import of
its model modules, ~3 s on the first architecture look-up, done before). The model is
``engine_bench.py``'s (1.34 GB bf16 Llama).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engine_bench import ROOT, interleaved_rounds, model_directory, summarise

from tests.engine_envs import sglang_environment
from tests.objstore import free_port

METHODS = {
    "auto": ("auto", {}),
    "weightstream": ("weightstream", {}),
    "weightstream-copy": ("weightstream", {"zero_copy": False}),
    "weightstream-layered": ("weightstream-layered", {}),
}
"""``weightstream``: the adapter's default on the CPU (local files mapped, ``zero_copy``); ``weightstream-copy``:
read into weightstream's own memory first; ``weightstream-layered``: parameters on meta, each layer's given memory
as it loads."""
RUN = r"""
import json, sys, time
from tests.sglang_check import start_sglang
start_sglang(sys.argv[1], int(sys.argv[4]))
from sglang.srt.configs.device_config import DeviceConfig
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.loader import get_model_loader
from sglang.srt.model_loader.utils import get_model_architecture
model_config = ModelConfig(sys.argv[1], dtype="bfloat16")
# imports every model module once (~3 s): not loading, and the same for every method
get_model_architecture(model_config)
load_config = LoadConfig(load_format=sys.argv[2], model_loader_extra_config=json.loads(sys.argv[3]))
loader = get_model_loader(load_config, model_config)
started = time.perf_counter()
loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
print("LOADED", time.perf_counter() - started)
"""


def run(python: str, environment: dict[str, str], model: Path, load_format: str, extra: dict) -> float:
    result = subprocess.run(
        [python, "-c", RUN, str(model), load_format, json.dumps(extra), str(free_port())],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environment,
        timeout=900,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("LOADED ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{load_format} {extra}: exit {result.returncode}:\n{result.stderr[-3000:]}")
    return float(lines[-1].split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    (python, environment), model = sglang_environment(), model_directory()
    files = sorted(str(path) for path in model.glob("*.safetensors"))
    methods = args.methods.split(",")
    runs = interleaved_rounds(
        methods, args.rounds, files, lambda method: run(python, environment, model, *METHODS[method])
    )
    summary = summarise(runs, "auto")
    if args.json:
        total = sum(os.path.getsize(path) for path in files)
        Path(args.json).write_text(
            json.dumps({"model": str(model), "bytes": total, "rounds": args.rounds, "summary": summary}, indent=2)
        )


if __name__ == "__main__":
    main()
