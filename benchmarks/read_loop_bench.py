"""The read loop at scale (issue 17 §4): a plan of 17,408 read requests (a 140 GB checkpoint in 8 MiB
requests has as many), loaded warm, this checkout against another (``--baseline DIR``), each run a
fresh process, rounds interleaved, medians.

    python benchmarks/read_loop_bench.py --baseline /tmp/before --rounds 5

The checkpoint is 17,408 tensors of 4 KiB read with ``chunk_bytes=4096``: every tensor its own
request, so the loop's cost per completion is what is measured, not the disk. ``--slow-ms`` delays
every read on the reader thread (as a remote store's latency would), which keeps thousands of reads
pending at once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TENSORS = 17_408
RUN = """
import sys, time
import torch, weightstream
from weightstream.sources.local.file import LocalFile
slow = float(sys.argv[2]) / 1000
if slow:
    read_into = LocalFile.read_into
    def delayed(self, offset, buffer):
        time.sleep(slow)
        read_into(self, offset, buffer)
    LocalFile.read_into = delayed
weightstream.load_weights(sys.argv[1], chunk_bytes=4096, threads=16, direct_io=False)  # warm every path once
start = time.perf_counter()
loaded = weightstream.load_weights(sys.argv[1], chunk_bytes=4096, threads=16, direct_io=False)
print(time.perf_counter() - start)
assert len(loaded) == int(sys.argv[3])
"""


def checkpoint(directory: str) -> str:
    import torch

    from weightstream.save.write import write_safetensors

    path = os.path.join(directory, "many.safetensors")
    write_safetensors(
        path,
        {
            f"model.layers.{number // 64}.w{number % 64}": torch.full((1024,), number, dtype=torch.int32)
            for number in range(TENSORS)
        },
    )
    return path


def run(checkout: str, path: str, slow_ms: float) -> float:
    environment = {**os.environ, "PYTHONPATH": checkout}
    result = subprocess.run(
        [sys.executable, "-c", RUN, path, str(slow_ms), str(TENSORS)],
        capture_output=True,
        text=True,
        env=environment,
        cwd=checkout,
        check=True,
    )
    return float(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="another checkout of weightstream to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--slow-ms", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    report = {}
    with tempfile.TemporaryDirectory() as scratch:
        path = checkpoint(scratch)
        for slow in args.slow_ms:
            seconds: dict[str, list[float]] = {"this": [], "baseline": []}
            for round_number in range(args.rounds):
                order = [("this", here), ("baseline", args.baseline)]
                for name, checkout in order if round_number % 2 == 0 else order[::-1]:
                    seconds[name].append(run(checkout, path, slow))
            medians = {name: statistics.median(values) for name, values in seconds.items()}
            report[f"slow_ms={slow}"] = {"seconds": seconds, "medians": medians}
            print(
                f"{TENSORS} requests, reads delayed {slow} ms: this {medians['this']:.2f} s, baseline "
                f"{medians['baseline']:.2f} s "
                f"({medians['baseline'] / medians['this']:.2f}x)"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
