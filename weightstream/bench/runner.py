"""Interleaved benchmark rounds: each method in a fresh process, cold and warm page cache, medians.

Example:
    >>> report = run_bench("/models/llama", rounds=3)  # doctest: +SKIP
    >>> print(format_table(report))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence

from weightstream.bench.methods import (
    METHODS_BY_DEVICE,
    NODE_CACHE_METHODS,
    RUN_WHEN_NAMED,
    SETTINGS,
    memory_of,
    missing_module,
)
from weightstream.bench.remote_methods import REMOTE_METHODS, remote_skip_reason
from weightstream.bench.worker import REMOTE, file_sizes
from weightstream.errors import BenchmarkError, CacheError, DeviceUnavailableError, InvalidOptionError
from weightstream.memory.devices import cuda_available
from weightstream.planning.discover import find_files
from weightstream.sources import REMOTE_SCHEMES, store_for
from weightstream.sources.local import pagecache

CACHES = ("cold", "warm")
SERVER_CACHE = "server"
"""The cache state of runs against an object store: whatever the server's own caches hold."""
COLD_RESIDENCY = 0.02
WARM_RESIDENCY = 0.98
PREPARE_TRIES = 3
WORKER_TIMEOUT_S = 900


@dataclasses.dataclass
class Row:
    """The runs of one method under one page-cache state."""

    method: str
    cache: str
    device: str = "cpu"
    runs: list[dict] = dataclasses.field(default_factory=list)
    skipped: str | None = None
    failed: str | None = None
    """Why a run of this method failed (its later rounds are not run); its runs before that are dropped."""

    @property
    def gbps(self) -> list[float]:
        return [run["bytes"] / run["seconds"] / 1e9 for run in self.runs]

    def summary(self) -> dict:
        if self.failed:
            return {"method": self.method, "cache": self.cache, "failed": self.failed}
        if self.skipped or not self.runs:
            return {"method": self.method, "cache": self.cache, "skipped": self.skipped or "no runs"}
        firsts = [run["first_tensor_seconds"] for run in self.runs if run["first_tensor_seconds"] is not None]
        device_peaks = {
            f"{key}_median": statistics.median(run[key] for run in self.runs)
            for key in ("peak_device_bytes", "peak_pinned_bytes")
            if all(key in run for run in self.runs)
        }
        return {
            "method": self.method,
            "cache": self.cache,
            "memory": memory_of(self.method, self.device),
            **({"settings": SETTINGS[self.method]} if self.device == "cpu" and self.method in SETTINGS else {}),
            "gbps_median": statistics.median(self.gbps),
            "gbps_min": min(self.gbps),
            "gbps_max": max(self.gbps),
            "seconds_median": statistics.median(run["seconds"] for run in self.runs),
            "first_tensor_seconds_median": statistics.median(firsts) if firsts else None,
            "peak_rss_above_baseline_median": statistics.median(
                run["peak_rss"] - run["baseline_rss"] for run in self.runs
            ),
            **device_peaks,
            "runs": len(self.runs),
        }


@dataclasses.dataclass
class BenchReport:
    uri: str
    files: list[str]
    total_bytes: int
    rounds: int
    rows: list[Row]
    machine: dict
    device: str = "cpu"

    def to_json(self) -> dict:
        return {
            "uri": self.uri,
            "device": self.device,
            "files": self.files,
            "total_bytes": self.total_bytes,
            "rounds": self.rounds,
            "machine": self.machine,
            "results": [row.summary() for row in self.rows],
            "ratios": ratios(self),
            "failed": {f"{row.method} ({row.cache})": row.failed for row in self.rows if row.failed},
        }

    def weightstream_failed(self) -> list[Row]:
        """The rows of weightstream's own methods that failed (a failing peer is reported, not fatal)."""
        return [row for row in self.rows if row.failed and row.method.startswith("weightstream")]


def run_bench(
    uri: str,
    methods: Sequence[str] | None = None,
    caches: Sequence[str] = CACHES,
    rounds: int = 3,
    on_run: Callable[[str], None] | None = None,
    device: str = "cpu",
) -> BenchReport:
    """Measure ``methods`` (default: all for ``device``) on the checkpoint at ``uri``: ``rounds``
    interleaved rounds per page-cache state, tensors landing on ``device`` ("cpu" or "cuda").

    Raises:
        InvalidOptionError: an unknown device, method or cache state, or ``rounds`` < 1.
        DeviceUnavailableError: ``device="cuda"`` on a machine without CUDA.
    """
    check_device(device)
    remote = uri.startswith(REMOTE_SCHEMES)
    if remote and device != "cpu":
        raise InvalidOptionError(
            f"bench of an object-store checkpoint lands tensors on the CPU; --device {device} is for local files"
        )
    known = REMOTE_METHODS if remote else METHODS_BY_DEVICE[device]
    methods = [m for m in known if m not in RUN_WHEN_NAMED] if methods is None else list(methods)
    if remote:
        caches = (SERVER_CACHE,)  # the server's page cache is its own; the worker does not control it
    unknown = [m for m in methods if m not in known] + [c for c in caches if c not in (*CACHES, SERVER_CACHE)]
    if unknown:
        raise InvalidOptionError(
            f"unknown method or cache {unknown}; {device} methods: {', '.join(known)}; caches: {', '.join(CACHES)}"
        )
    if rounds < 1:
        raise InvalidOptionError(f"rounds must be at least 1, got {rounds}")
    files = find_files_of(uri)
    worker_device = REMOTE if remote else device
    rows = {
        (m, c): Row(m, c, device, skipped=remote_skip_reason(m, uri) if remote else _why_skipped(m, device))
        for c in caches
        for m in methods
    }
    daemon = node_cache(uri) if NODE_CACHE_METHODS & set(methods) else contextlib.nullcontext()
    with daemon:
        _rounds(rounds, caches, methods, rows, remote, files, worker_device, uri, on_run)
    return BenchReport(uri, files, sum(file_sizes(uri, files)), rounds, list(rows.values()), _machine(device), device)


@contextlib.contextmanager
def node_cache(uri: str) -> Iterator[str]:
    """A cache daemon of the bench's own (segments in ``/dev/shm``), holding ``uri`` before the first round, its
    socket in ``$WEIGHTSTREAM_CACHE`` for the workers; stopped and removed afterwards."""
    from weightstream.bench.cache_daemon import daemon_process

    token = f"{os.getpid()}-{os.urandom(3).hex()}"
    directory, socket_path = f"/dev/shm/weightstream-bench-{token}", f"/tmp/weightstream-bench-{token}.sock"
    previous = os.environ.get("WEIGHTSTREAM_CACHE")
    try:
        with daemon_process(directory, socket_path, prefetch=uri):
            os.environ["WEIGHTSTREAM_CACHE"] = socket_path
            yield socket_path
    except CacheError as error:
        raise BenchmarkError(f"the bench's cache daemon: {error}") from error
    finally:
        if previous is None:
            os.environ.pop("WEIGHTSTREAM_CACHE", None)
        else:
            os.environ["WEIGHTSTREAM_CACHE"] = previous


def _rounds(
    rounds: int,
    caches: Sequence[str],
    methods: list[str],
    rows: dict[tuple[str, str], Row],
    remote: bool,
    files: list[str],
    worker_device: str,
    uri: str,
    on_run: Callable[[str], None] | None,
) -> None:
    for round_number in range(rounds):
        shift = round_number % max(1, len(methods))
        in_turn = methods[shift:] + methods[:shift]
        for cache in caches:
            for method in in_turn:
                row = rows[(method, cache)]
                if row.skipped or row.failed:
                    continue
                if not remote:
                    prepare_cache(files, cache)
                try:
                    row.runs.append(run_worker(worker_device, method, uri, files))
                except BenchmarkError as error:
                    row.failed, row.runs = str(error), []
                    if on_run is not None:
                        on_run(
                            f"round {round_number + 1}/{rounds} {cache:4s} {method:24s} FAILED: "
                            f"{_first_line(row.failed)}"
                        )
                    continue
                if on_run is not None:
                    run = row.runs[-1]
                    on_run(
                        f"round {round_number + 1}/{rounds} {cache:4s} {method:24s} "
                        f"{run['bytes'] / run['seconds'] / 1e9:6.2f} GB/s"
                    )


def planned_runs(uri: str, methods: Sequence[str] | None, caches: Sequence[str], rounds: int, device: str) -> int:
    """How many fresh-process runs :func:`run_bench` will make (the methods installed here, each cache, each round).

    Example:
        >>> planned_runs("model/", ["weightstream", "limit-read-reused"], ["cold", "warm"], 3, "cpu")
        12
    """
    known = METHODS_BY_DEVICE[device]
    chosen = [m for m in known if m not in RUN_WHEN_NAMED] if methods is None else list(methods)
    installed = [m for m in chosen if m in known and _why_skipped(m, device) is None]
    return len(installed) * len(caches) * rounds


def find_files_of(uri: str) -> list[str]:
    """The checkpoint files at ``uri`` (a path or an object store's URI)."""
    with contextlib.closing(store_for(uri)) as store:
        return list(find_files(store, uri).files)


def check_device(device: str) -> None:
    """Raise unless the benchmark can land tensors on ``device`` here.

    Example:
        >>> check_device("cpu")
    """
    if device not in METHODS_BY_DEVICE:
        raise InvalidOptionError(f"unknown benchmark device {device!r}; devices: {', '.join(METHODS_BY_DEVICE)}")
    if device == "cuda" and not cuda_available():
        raise DeviceUnavailableError("bench --device cuda: torch sees no CUDA device on this machine")


def ratios(report: BenchReport) -> dict[str, dict[str, float]]:
    """weightstream's median GB/s divided by every other method's, per cache state."""
    medians = {(row.method, row.cache): statistics.median(row.gbps) for row in report.rows if row.runs}
    result: dict[str, dict[str, float]] = {}
    for (method, cache), value in medians.items():
        ours = medians.get(("weightstream", cache))
        if ours is not None and method != "weightstream":
            result.setdefault(cache, {})[method] = ours / value
    return result


def format_table(report: BenchReport) -> str:
    """A plain-text table of the report, with weightstream's ratio to each method."""
    on_gpu = report.device == "cuda"
    width = max([24, *(len(row.method) for row in report.rows)])
    lines = [
        (
            f"checkpoint: {report.uri} ({report.total_bytes / 2**30:.2f} GiB in {len(report.files)} files) to "
            f"{report.device}, "
            f"{report.rounds} interleaved rounds, each run a fresh process; medians (min-max)"
        ),
        f"{'cache':5s} {'method':{width}s} {'memory':6s} {'GB/s':>22s} {'first tensor':>13s} {'peak RSS +':>11s} "
        + (f"{'GPU +':>9s} {'pinned':>9s} " if on_gpu else "")
        + f"{'ws ratio':>9s}",
    ]
    table_ratios = ratios(report)
    for row in report.rows:
        summary = row.summary()
        if "skipped" in summary:
            lines.append(f"{row.cache:5s} {row.method:{width}s} skipped: {summary['skipped']}")
            continue
        if "failed" in summary:
            lines.append(f"{row.cache:5s} {row.method:{width}s} FAILED: {_first_line(summary['failed'])}")
            continue
        first = summary["first_tensor_seconds_median"]
        ratio = table_ratios.get(row.cache, {}).get(row.method)
        lines.append(
            f"{row.cache:5s} {row.method:{width}s} {summary['memory']:6s} {summary['gbps_median']:7.2f} "
            f"({summary['gbps_min']:5.2f}-{summary['gbps_max']:5.2f}) "
            f"{(f'{first * 1000:9.0f} ms' if first is not None else '        n/a'):>13s} "
            f"{summary['peak_rss_above_baseline_median'] / 2**20:8.0f} MiB "
            + (
                f"{summary['peak_device_bytes_median'] / 2**30:5.2f} GiB "
                f"{summary['peak_pinned_bytes_median'] / 2**20:5.0f} MiB "
                if on_gpu
                else ""
            )
            + f"{(f'{ratio:8.2f}x' if ratio is not None else ''):>9s}"
        )
    lines.append(
        "ws ratio: weightstream's median GB/s over the method's (above 1: weightstream is faster); cold: the files "
        "dropped from the page cache before each run (checked with mincore)"
        + (
            "; the node-cache row reads the bench's own daemon, filled before the first round, so its 'cold' is the "
            "page cache's state, not the cache's: its segments are in shared memory either way"
            if any(row.method in NODE_CACHE_METHODS and row.runs for row in report.rows)
            else ""
        )
    )
    measured = list(dict.fromkeys(row.method for row in report.rows if row.runs))
    if report.device == "cpu" and any(method in SETTINGS for method in measured):
        lines.append("settings:")
        lines.extend(f"  {method:{width}s} {SETTINGS[method]}" for method in measured if method in SETTINGS)
    if any(row.summary().get("memory") == "mapped" for row in report.rows):
        lines.append(
            "memory 'mapped': views of the page cache (or the cache daemon's shared memory), no copy made; warm, "
            "such a run maps pages while an 'owned' one copies every byte into memory of its own"
        )
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    """A bar chart (linear axis) of median GB/s per method and cache state, from ``BenchReport.to_json()``; a method
    whose tensors are views of a mapping is labelled so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in summary["results"] if "skipped" not in r and "failed" not in r]
    caches = [c for c in (*CACHES, SERVER_CACHE) if any(r["cache"] == c for r in results)]
    methods = list(dict.fromkeys(r["method"] for r in results))
    figure, axes = plt.subplots(figsize=(11, 4.8))
    width = 0.8 / max(1, len(caches))
    for number, cache in enumerate(caches):
        values = [
            next((r["gbps_median"] for r in results if r["method"] == m and r["cache"] == cache), 0.0) for m in methods
        ]
        bars = axes.bar(
            [i + number * width for i in range(len(methods))],
            values,
            width,
            label=f"{cache} cache" if cache == SERVER_CACHE else f"{cache} page cache",
        )
        axes.bar_label(bars, fmt="%.2f", fontsize=7)
    mapped = {r["method"] for r in results if r.get("memory") == "mapped"}
    labels = [f"{m} (mapped)" if m in mapped else m for m in methods]
    axes.set_xticks([i + width * (len(caches) - 1) / 2 for i in range(len(methods))], labels, rotation=20, ha="right")
    axes.set_ylabel("GB/s to all tensors materialised (median)")
    axes.set_title(f"{summary['total_bytes'] / 2**30:.2f} GiB checkpoint, {summary['rounds']} interleaved rounds")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _why_skipped(method: str, device: str) -> str | None:
    module = missing_module(method, device)
    return f"{module} is not installed" if module else None


def prepare_cache(files: list[str], cache: str) -> None:
    """Drop ``files`` from the page cache (``cold``) or read them into it (``warm``), and check that it worked.

    A file the kernel partly evicts again under memory pressure (seen on a 2-CPU CI machine: 97 % of 1 GiB
    resident just after reading it) is prepared again, up to :data:`PREPARE_TRIES` times in all; one still
    off then raises :class:`BenchmarkError` with its residency and the memory the kernel said was available.
    """
    pending = list(files)
    for _ in range(PREPARE_TRIES):
        for path in pending:
            if cache == "cold":
                pagecache.drop(path)
            else:
                pagecache.warm(path)
        pending = [path for path in pending if not _prepared(path, cache)]
        if not pending:
            return
    path = pending[0]
    raise BenchmarkError(
        f"{path}: {pagecache.resident_fraction(path):.0%} resident in the page cache after preparing a {cache} run "
        f"{PREPARE_TRIES} times ({_available_memory()}); the figure would be wrong"
    )


def _prepared(path: str, cache: str) -> bool:
    resident = pagecache.resident_fraction(path)
    return resident <= COLD_RESIDENCY if cache == "cold" else resident >= WARM_RESIDENCY


def _available_memory() -> str:
    with contextlib.suppress(OSError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB available"
    return "available memory unknown"


def run_worker(device: str, method: str, uri: str, files: list[str]) -> dict:
    """One measurement of ``method`` in a fresh process (``weightstream.bench.worker``), as its JSON.

    Raises:
        BenchmarkError: the worker failed, ran past :data:`WORKER_TIMEOUT_S` or printed no result; the
            message ends with the last line of its error output (the exception that ended it).
    """
    command = [sys.executable, "-m", "weightstream.bench.worker", device, method, uri, *files]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise BenchmarkError(f"benchmark of {method} ran past {WORKER_TIMEOUT_S} s") from None
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or ["(no error output)"]
        raise BenchmarkError(f"benchmark of {method} failed (exit {result.returncode}): {lines[-1][-500:]}")
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise BenchmarkError(f"benchmark of {method} printed no result: {result.stdout[-500:]!r}") from None


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else text


def _machine(device: str) -> dict:
    machine = {
        "cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "thp": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
    }
    if device == "cuda":
        import torch

        machine["gpu"] = torch.cuda.get_device_name(0)
        machine["torch_cuda"] = torch.version.cuda
    return machine


def _read(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return None
