"""Run on a small filesystem mounted at DIRECTORY: save a state that fits, then one that does not,
and print as JSON what the failed save raised, what it left, and whether the first state still
loads bit-exact. ``python -m tests.sharded_full_disk DIRECTORY``."""

from __future__ import annotations

import json
import os
import sys

import torch

import weightstream


def main(directory: str) -> dict:
    small = {"model.layers.0.w": torch.arange(1000, dtype=torch.float32)}
    weightstream.save_sharded_state(small, directory, rank=0, world_size=1)
    before = sorted(os.listdir(directory))
    free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
    big = {f"model.layers.{n}.w": torch.ones(free // 8, dtype=torch.uint8) for n in range(12)}  # 1.5x the free space
    result: dict = {"before": before}
    try:
        weightstream.save_sharded_state(big, directory, rank=0, world_size=1, max_file_bytes=free // 4)
        result["error"] = None
    except weightstream.WeightstreamError as error:
        result["error"] = [type(error).__name__, str(error), isinstance(error, OSError)]
    result["after"] = sorted(os.listdir(directory))
    loaded = weightstream.load_weights(directory, format="sharded-state", verify=True)
    result["first_state_intact"] = set(loaded) == set(small) and all(torch.equal(loaded[n], small[n]) for n in small)
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
