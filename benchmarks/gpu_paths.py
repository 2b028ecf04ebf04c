"""Every CUDA route of weightstream, once each, on a small demo checkpoint, each load checked byte for byte against a
CPU load and the route it took named (``readers.destination.choose_destination``'s answer for the same options).

    python benchmarks/gpu_paths.py [--size 256MiB]

One line per route (``ok``, ``skipped: why`` or ``FAILED: why``); exit 1 if one failed, 77 without a GPU (after
building the demo: the non-GPU part).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import weightstream
from weightstream.arguments import parse_size
from weightstream.bench.demo import demo_checkpoint
from weightstream.bench.digests import byte_sums
from weightstream.errors import DeviceUnavailableError
from weightstream.readers.destination import choose_destination
from weightstream.registry import check_options
from weightstream.sources import store_for

ROUTES = (
    ("staged ring, safetensors", {"device": "cuda"}),
    ("staged ring, streaming", {"device": "cuda", "format": "streaming", "max_inflight_bytes": 64 << 20}),
    ("staged ring, layered", {"device": "cuda", "format": "layered", "copy_layers": True}),
    ("gds", {"device": "cuda", "gds": True}),
    ("pinned host", {"pin_memory": True}),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=256 << 20)
    args = parser.parse_args()
    uri = demo_checkpoint(args.size, shards=2, cache_dir="/tmp/ws-gpu-check")
    if not torch.cuda.is_available():
        print(f"built {uri}; no CUDA device: no route to check")
        return 77
    expected = byte_sums(weightstream.load_weights(uri))
    failed = False
    for label, options in ROUTES:
        format = str(options.get("format", "safetensors"))
        try:
            core, _ = check_options(format, {key: value for key, value in options.items() if key != "format"})
            with contextlib.closing(store_for(uri)) as store:
                route = choose_destination(store, uri, core, format).route.value
            loaded = weightstream.load_weights(uri, **options)
        except DeviceUnavailableError as error:
            print(f"{label:28s} skipped: {error}")
            continue
        except Exception as error:  # noqa: BLE001 - every route is tried; each failure is said
            print(f"{label:28s} FAILED: {type(error).__name__}: {error}")
            failed = True
            continue
        got = byte_sums(loaded)
        wrong = sorted(name for name in expected if got.get(name) != expected[name])
        devices = sorted({str(t.device) for t in loaded.values()})
        status = "ok" if not wrong else f"FAILED: bytes differ in {wrong[:3]}"
        failed |= bool(wrong)
        print(f"{label:28s} {status} (route {route}, tensors on {', '.join(devices)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
