"""Peak GPU memory of an engine-style load: parameters allocated first, then every tensor copied into
its parameter and dropped, as vLLM's and SGLang's ``load_weights`` do. With the windowed staged reader
the peak above the parameters is the window (plus the tensor last handed over), not the checkpoint.

Run on a CUDA machine (benchmarks/gpu_check.sh runs it):
    python benchmarks/device_window.py --size 2GiB --json > device-window.json
Exit status 1 when a load's peak above the parameters exceeds window + largest tensor.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

import weightstream
from weightstream.arguments import parse_size
from weightstream.bench.demo import demo_checkpoint
from weightstream.options import DEFAULT_INFLIGHT_BYTES


def engine_style_load(uri: str, device: str, **options: object) -> dict[str, float]:
    """Parameters first, then the weights copied in one by one; the peak device memory above the parameters."""
    with weightstream.open(uri, **options, device=device) as checkpoint:
        plan = checkpoint.plan
    parameters = {spec.name: torch.empty(spec.shape, dtype=spec.dtype, device=device) for spec in plan.tensors}
    parameter_bytes = sum(spec.nbytes for spec in plan.tensors)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    started = time.perf_counter()
    for name, tensor in weightstream.iter_weights(uri, device=device, **options):
        parameters[name].copy_(tensor)
        del tensor
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    return {
        "parameter_bytes": parameter_bytes,
        "peak_above_parameters": torch.cuda.max_memory_allocated(device) - baseline,
        "largest_tensor": max(spec.nbytes for spec in plan.tensors),
        "seconds": seconds,
        "gb_per_s": parameter_bytes / seconds / 1e9,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GiB")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("device_window.py measures GPU memory: this machine has no CUDA device", file=sys.stderr)
        return 77  # skipped (benchmarks/gpu_check.py's convention)
    results = []
    with tempfile.TemporaryDirectory() as directory:
        uri = demo_checkpoint(parse_size(args.size), shards=4, cache_dir=directory)
        for label, options, window in (
            ("safetensors (default window)", {"format": "safetensors"}, DEFAULT_INFLIGHT_BYTES),
            (
                "streaming, max_inflight_bytes=256 MiB",
                {"format": "streaming", "max_inflight_bytes": 256 << 20},
                256 << 20,
            ),
        ):
            result = engine_style_load(uri, args.device, **options)
            result.update(
                load=label,
                window=window,
                bounded=result["peak_above_parameters"] <= window + result["largest_tensor"] + 4096,
            )
            results.append(result)
            if not args.json:
                print(
                    f"{label}: {result['peak_above_parameters'] / 2**20:.0f} MiB above "
                    f"{result['parameter_bytes'] / 2**20:.0f} MiB "
                    f"of parameters (window {window / 2**20:.0f} MiB), {result['gb_per_s']:.2f} GB/s"
                )
    if args.json:
        print(json.dumps(results, indent=2))
    return 0 if all(result["bounded"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
