"""The node cache's round trip where numpy is not installed (CI runs it in a venv of torch and weightstream
alone): a daemon fills a checkpoint, a client loads it as views, a second load attaches; no numpy imported."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import weightstream
from weightstream.save.write import write_safetensors

assert importlib.util.find_spec("numpy") is None, "this check needs an environment without numpy"
with tempfile.TemporaryDirectory(dir="/dev/shm") as scratch:
    tensors = {"w": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16)}
    checkpoint = Path(scratch) / "model.safetensors"
    write_safetensors(str(checkpoint), tensors)
    socket_path = f"{scratch}/cache.sock"
    serve = [sys.executable, "-m", "weightstream.cli", "cache", "serve", "--json"]
    daemon = subprocess.Popen([*serve, "--dir", f"{scratch}/segments", "--socket", socket_path], stdout=subprocess.PIPE)
    try:
        assert json.loads(daemon.stdout.readline())["entries"] == 0  # listening
        for _ in range(2):
            loaded = weightstream.load_weights(checkpoint, cache=socket_path)
            assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)
    finally:
        daemon.terminate()
        assert daemon.wait(timeout=60) == 0
        daemon.stdout.close()
assert "numpy" not in sys.modules
print("the cache round trip without numpy: filled, then attached")
