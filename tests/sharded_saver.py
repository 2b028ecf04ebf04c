"""Save in a fresh process, for the crash and concurrency tests:
``python -m tests.sharded_saver DIRECTORY SEED TIMES [MAX_FILE_BYTES]`` saves the state of ``SEED``
as rank 0 of 1, ``TIMES`` times over, printing ``ready`` before the first and ``saved SECONDS`` after each."""

from __future__ import annotations

import sys
import time

import weightstream
from weightstream.bench.demo import LlamaShape, llama_state_dict

SHAPE = LlamaShape(hidden=256, intermediate=704, layers=4, vocab=1000)


def state(seed: int):
    return llama_state_dict(SHAPE, seed=seed)


def main(directory: str, seed: int, times: int, max_file_bytes: int) -> None:
    tensors = state(seed)
    print("ready", flush=True)
    for _ in range(times):
        start = time.perf_counter()
        weightstream.save_sharded_state(tensors, directory, rank=0, world_size=1, max_file_bytes=max_file_bytes)
        print(f"saved {time.perf_counter() - start:.4f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 256 << 10)
