"""What checking every OCI blob against its digest costs: the same load of a 1 GiB demo artifact from a local
registry in fresh processes, hashing on and off (``BlobHash.feed`` replaced by a no-op), alternating.

    python benchmarks/oci_hash_ab.py --rounds 3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LOAD = """
import sys, time
import weightstream, weightstream.sources.oci.digest as blob_hash
if sys.argv[2] == "off":
    blob_hash.BlobHash.feed = lambda self, at, piece: None
started = time.perf_counter()
weights = weightstream.load_weights(sys.argv[1])
total = sum(t.numel() * t.element_size() for t in weights.values())
print(total / (time.perf_counter() - started) / 1e9)
"""


def main() -> int:
    from tests.objstore import oci_registry
    from weightstream.arguments import parse_size
    from weightstream.bench.demo import demo_checkpoint
    from weightstream.save.push import push

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=1 << 30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    local = demo_checkpoint(args.size)
    with tempfile.TemporaryDirectory(prefix="weightstream-oci-") as scratch, oci_registry(Path(scratch)) as address:
        uri = f"oci://{address}/bench/llama:v1"
        push(local, uri)
        for _ in range(args.rounds):
            for hashing in ("on", "off"):
                ran = subprocess.run(
                    [sys.executable, "-c", LOAD, uri, hashing], capture_output=True, text=True, check=True, cwd=ROOT
                )
                print(f"hash {hashing:3s} {float(ran.stdout):.2f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
