"""The GPU check: every CUDA path of weightstream, proven in one bounded run on a lent GPU machine.

    python3 benchmarks/gpu_check.py --list            # the plan: one line per step, its limit in seconds last
    python3 benchmarks/gpu_check.py run               # on the GPU machine (OUT=... for the results)
    python3 benchmarks/gpu_check.py run --dry-run     # here, without a GPU: every step's non-GPU part, small sizes

Each step runs in a process group of its own under its own limit (SIGINT first, so that pytest prints what failed,
SIGKILL 10 s later), writes its output to the run's log, and the run goes on after a failure. Exit status 77 from a
step means skipped (no CUDA device, a wheel missing); the summary says why. At the end, ``$OUT`` holds at most 8
files: ``summary.txt`` (step, status, seconds, figure), ``steps.log`` (every step's output, in order), and each
step's JSON (``stack.json``, ``device-window.json``, ``cache-gpu.json``, ``bench-warm.json``, ``bench-cold.json``).
The limits sum to at most 480 s, the installs included, inside the device tool's 600 s per call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
SITE = Path("/tmp/site")
SKIPPED = 77
GRACE_S = 10
BUDGET_S = 480
CUDA_TESTS_OF_THE_CACHE = ("tests/test_cache_gpu_tier.py", "tests/test_segment_copies.py")
FLEET_GPU_TEST = "tests/test_fleet_gpu.py"


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    limit_s: int
    command: Callable[[Path, bool], list[str]]
    """(OUT, dry run) -> the command line."""
    figure: Callable[[Path, str], str] = lambda out, log: ""
    """(OUT, the step's output) -> the one figure the summary shows."""


def python(*arguments: str) -> list[str]:
    return [sys.executable, *arguments]


def pytest_figure(out: Path, log: str) -> str:
    lines = [line for line in log.splitlines() if " passed" in line or " failed" in line or " skipped" in line]
    return lines[-1].strip("= ") if lines else ""


def bench_figure(name: str) -> Callable[[Path, str], str]:
    def figure(out: Path, log: str) -> str:
        path = out / f"{name}.json"
        if not path.exists():
            return ""
        report = json.loads(path.read_text())
        rows = {r["method"]: r for r in report["results"] if "gbps_median" in r}
        ours, limit = rows.get("weightstream"), rows.get("limit-h2d-pinned")
        if ours is None:
            return "weightstream did not run"
        ratio = f", {ours['gbps_median'] / limit['gbps_median']:.2f}x pinned H2D" if limit else ""
        return f"weightstream {ours['gbps_median']:.2f} GB/s{ratio}"

    return figure


STEPS = (
    Step(
        "install",
        25,
        lambda out, dry: python(str(Path(__file__).resolve()), "install-wheels"),
        lambda out, log: log.strip().splitlines()[-1] if log.strip() else "",
    ),
    Step(
        "stack",
        20,
        lambda out, dry: python("benchmarks/gpu_stack.py", "--json", str(out / "stack.json")),
        lambda out, log: ", ".join(line for line in log.splitlines() if line.startswith(("torch:", "driver_cuda"))),
    ),
    Step(
        "paths",
        15,
        lambda out, dry: python("benchmarks/gpu_paths.py", "--size", "64MiB" if dry else "256MiB"),
        lambda out, log: f"{log.count(' ok ')} ok, {log.count('FAILED')} failed, {log.count('skipped:')} skipped",
    ),
    Step(
        "ring-tests",
        65,
        lambda out, dry: python(
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "-m",
            "cuda",
            "tests",
            *(f"--ignore={path}" for path in (*CUDA_TESTS_OF_THE_CACHE, FLEET_GPU_TEST)),
        ),
        pytest_figure,
    ),
    Step(
        "cache-tier-tests",
        65,
        lambda out, dry: python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *CUDA_TESTS_OF_THE_CACHE),
        pytest_figure,
    ),
    Step(
        "fleet-gpu",
        30,
        lambda out, dry: python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-rs", FLEET_GPU_TEST),
        pytest_figure,
    ),
    Step(
        "device-window",
        40,
        lambda out, dry: python("benchmarks/device_window.py", "--size", "64MiB" if dry else "2GiB", "--json"),
        lambda out, log: "",
    ),
    Step(
        "cache-gpu-bench",
        70,
        lambda out, dry: python(
            "benchmarks/cache_gpu_bench.py",
            "--size",
            "64MiB" if dry else "2GiB",
            "--rounds",
            "1" if dry else "2",
            "--json",
            str(out / "cache-gpu.json"),
        ),
        lambda out, log: next((line for line in log.splitlines() if line.startswith("cache-host:")), ""),
    ),
    *(
        Step(
            f"bench-{cache}",
            75,
            lambda out, dry, cache=cache: python(
                str(Path(__file__).resolve()),
                "bench",
                cache,
                str(out / f"bench-{cache}.json"),
                "--dry-run" if dry else "",
            ),
            bench_figure(f"bench-{cache}"),
        )
        for cache in ("warm", "cold")
    ),
)


def run_step(step: Step, out: Path, dry: bool, log: list[str]) -> tuple[str, float, str]:
    """Run ``step`` under its limit; (status, seconds, figure). Its output is appended to ``log``."""
    command = [part for part in step.command(out, dry) if part]
    environment = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": f"{ROOT}:{SITE}:{os.environ.get('PYTHONPATH', '')}",
    }
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=step.limit_s - GRACE_S)
        status = {0: "ok", SKIPPED: "skipped"}.get(process.returncode, f"failed ({process.returncode})")
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)  # pytest prints its failures on an interrupt
        try:
            output, _ = process.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        status = f"timed out ({step.limit_s} s)"
    seconds = time.monotonic() - started
    log.append(f"===== {step.name} ({' '.join(command)}): {status} in {seconds:.1f} s\n{output}")
    try:
        figure = step.figure(out, output)
    except (OSError, ValueError, KeyError) as error:
        figure = f"(no figure: {error})"
    if status == "skipped" and not figure:
        figure = (output.strip().splitlines() or [""])[-1]
    return status, seconds, figure


def run(out: Path, dry: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    log: list[str] = []
    rows = []
    for step in STEPS:
        status, seconds, figure = run_step(step, out, dry, log)
        rows.append((step.name, status, seconds, figure))
        print(f"{step.name:18s} {status:22s} {seconds:6.1f} s  {figure}", flush=True)
    (out / "steps.log").write_text("\n".join(log))
    width = max(len(name) for name, *_ in rows)
    table = [f"{'step':{width}s}  {'status':22s} {'seconds':>7s}  figure"]
    table += [f"{name:{width}s}  {status:22s} {seconds:7.1f}  {figure}" for name, status, seconds, figure in rows]
    summary = "\n".join(table) + f"\n{'dry run, ' if dry else ''}{sum(r[2] for r in rows):.0f} s in all\n"
    (out / "summary.txt").write_text(summary)
    print(summary)
    return 1 if any(status.startswith(("failed", "timed out")) for _, status, _, _ in rows) else 0


def install_wheels() -> int:
    """Each wheel of ``.whl/`` into /tmp/site on its own: a missing or broken one costs only its own peer."""
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        print(f"no wheels in {WHEELS} (benchmarks/gpu_check.sh prepare): peers not installed are skipped")
        return SKIPPED
    installed = []
    for wheel in wheels:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-cache-dir",
                "--upgrade",
                "--target",
                str(SITE),
                str(wheel),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        print(f"{wheel.name}: {'installed' if result.returncode == 0 else 'FAILED ' + result.stderr.strip()[-200:]}")
        installed += [wheel.name] if result.returncode == 0 else []
    print(f"{len(installed)} of {len(wheels)} wheels installed")
    return 0 if installed else 1


def bench(cache: str, json_path: str, dry: bool) -> int:
    """``weightstream bench --device cuda`` on a demo checkpoint, one page-cache state; the demo is built (the
    non-GPU part) before CUDA is looked for."""
    import torch

    from weightstream.bench.demo import demo_checkpoint

    uri = demo_checkpoint((64 << 20) if dry else (4 << 30), shards=4, cache_dir="/tmp/ws-gpu-check")
    print(f"demo checkpoint: {uri}")
    if not torch.cuda.is_available():
        print("no CUDA device: the bench needs one")
        return SKIPPED
    command = [
        sys.executable,
        "-m",
        "weightstream.cli",
        "bench",
        uri,
        "--device",
        "cuda",
        "--rounds",
        "2",
        "--page-cache",
        cache,
        "--json",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    sys.stderr.write(result.stderr)
    Path(json_path).write_text(result.stdout)
    return result.returncode


def slim_wheel(wheel: str, into: str, leave_out: str) -> int:
    """Copy ``wheel`` into the folder ``into`` without its files under ``leave_out`` (and their RECORD lines)."""
    source = Path(wheel)
    target = Path(into) / source.name
    with zipfile.ZipFile(source) as original, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as slim:
        for item in original.infolist():
            if item.filename.startswith(leave_out):
                continue
            data = original.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"".join(
                    line for line in data.splitlines(keepends=True) if not line.startswith(leave_out.encode())
                )
            slim.writestr(item, data)
    print(f"{target}: {source.stat().st_size >> 20} MiB without {leave_out}: {target.stat().st_size >> 20} MiB")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the plan (step, limit in seconds) and exit")
    parser.add_argument("action", nargs="?", choices=("run", "install-wheels", "bench", "slim-wheel"), default=None)
    parser.add_argument("arguments", nargs="*")
    parser.add_argument("--dry-run", action="store_true", help="small sizes; steps needing CUDA skip without one")
    args = parser.parse_args()
    if args.list:
        for step in STEPS:
            print(f"{step.name} {step.limit_s}")
        return 0
    if args.action == "install-wheels":
        return install_wheels()
    if args.action == "slim-wheel":
        return slim_wheel(*args.arguments)
    if args.action == "bench":
        return bench(args.arguments[0], args.arguments[1], args.dry_run)
    if args.action == "run":
        return run(Path(os.environ.get("OUT") or "/tmp/gpu-check-out"), args.dry_run)
    parser.error("give --list, or run [--dry-run]")
    return 2


if __name__ == "__main__":
    sys.exit(main())
