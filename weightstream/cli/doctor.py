"""``weightstream doctor [PATH] [--json]``: what this machine gives a loader, checked in one place. Each finding is
``ok``, ``note`` (an optional piece absent: nothing fails for it unless asked for) or ``problem`` (something that will
fail or cost speed); the exit status is 1 when there is a problem. Credentials are looked for, never printed.

Example:
    >>> names = [finding.name for finding in run_checks(".")]  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib.metadata
import json
import mmap
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Iterator

from weightstream.sources.dependencies import MINIMUM_VERSIONS, release

OK, NOTE, PROBLEM = "ok", "note", "problem"
ALIGNMENT = 4096
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
LIBRARIES = (
    ("botocore", "s3://", "s3"),
    ("fsspec", "gs:// and az://", "gcs"),
    ("gcsfs", "gs://", "gcs"),
    ("adlfs", "az://", "azure"),
    ("azure-storage-blob", "az://", "azure"),
    ("cuda-bindings", "pinned memory, CUDA staging, GDS, the cache's GPU tier", "cuda"),
    ("nixl-cu12", "the node cache's fleet (--fleet)", "fleet"),
    ("safetensors", "the safetensors peer in bench", "bench"),
    ("runai-model-streamer", "the Run:ai peer in bench", "bench"),
    ("fastsafetensors", "the fastsafetensors peer in bench", "bench"),
    ("vllm", "--load-format weightstream in vLLM", None),
    ("sglang", "--load-format weightstream in SGLang", None),
)
"""Optional distributions, what each gives, and the extra of weightstream's that installs it (None: an engine, which
brings its own torch: docs/engines.md)."""
CREDENTIAL_PLACES: dict[str, tuple[tuple[str, str], ...]] = {
    "s3": (
        ("env", "AWS_ACCESS_KEY_ID"),
        ("env", "AWS_PROFILE"),
        ("env", "AWS_WEB_IDENTITY_TOKEN_FILE"),
        ("env", "AWS_CONTAINER_CREDENTIALS_FULL_URI"),
        ("env", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"),
        ("file", "~/.aws/credentials"),
        ("file", "~/.aws/config"),
    ),
    "gs": (
        ("env", "GOOGLE_APPLICATION_CREDENTIALS"),
        ("file", "~/.config/gcloud/application_default_credentials.json"),
    ),
    "az": (
        ("env", "AZURE_STORAGE_CONNECTION_STRING"),
        ("env", "AZURE_STORAGE_ACCOUNT_KEY"),
        ("env", "AZURE_STORAGE_SAS_TOKEN"),
    ),
    "hf": (("env", "HF_TOKEN"), ("file", "$HF_HOME/token")),
    "oci": (("file", "$DOCKER_CONFIG/config.json"),),
}
"""Where each scheme's standard credentials live (an instance role or workload identity is found only at run time:
a note says so)."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """One check: its name, ``ok`` | ``note`` | ``problem``, and what was found."""

    name: str
    status: str
    detail: str


def add_doctor_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``doctor``."""
    doctor = commands.add_parser(
        "doctor", allow_abbrev=False, help="check what this machine gives a loader (exit 1 on a problem)"
    )
    doctor.add_argument(
        "path", nargs="?", default=".", help="where checkpoints are read from: checked for O_DIRECT (default .)"
    )
    doctor.add_argument("--json", action="store_true", help="the findings as JSON")
    doctor.set_defaults(run=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    findings = run_checks(args.path)
    problems = sum(finding.status == PROBLEM for finding in findings)
    if args.json:
        print(json.dumps({"findings": [dataclasses.asdict(f) for f in findings], "problems": problems}, indent=2))
    else:
        width = max(len(finding.name) for finding in findings)
        for finding in findings:
            print(f"{finding.status:8s} {finding.name:{width}s}  {finding.detail}")
        print(f"{problems} problem(s)" if problems else "no problems")
    return 1 if problems else 0


def run_checks(path: str) -> list[Finding]:
    """Every check, in order; one that fails unexpectedly is a problem naming its error, and the others still run."""
    checks: list[tuple[str, Callable[[], Iterator[Finding]]]] = [
        ("system", _system),
        ("torch", _torch),
        ("o_direct", lambda: _direct_io(path)),
        ("huge_pages", _huge_pages),
        ("libraries", _libraries),
        ("credentials", _credentials),
        ("cache_daemon", _cache_daemon),
    ]
    findings = []
    for name, check in checks:
        try:
            findings.extend(check())
        except Exception as error:  # noqa: BLE001 - a doctor reports what broke and goes on
            findings.append(Finding(name, PROBLEM, f"the check failed: {error!r}"))
    return findings


def _system() -> Iterator[Finding]:
    from weightstream import __version__

    linux = sys.platform.startswith("linux")
    yield Finding(
        "system",
        OK if linux else PROBLEM,
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}, weightstream {__version__}"
        + ("" if linux else ": weightstream reads with preadv, O_DIRECT and mincore, which are Linux's"),
    )


def _torch() -> Iterator[Finding]:
    import torch

    built = torch.version.cuda
    if not built:
        yield Finding("torch", OK, f"{torch.__version__}, a CPU build: loads land on the CPU only")
        return
    if not torch.cuda.is_available():
        yield Finding("torch", NOTE, f"{torch.__version__}, built for CUDA {built}, but it sees no GPU")
        return
    names = ", ".join(torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count()))
    yield Finding("torch", OK, f"{torch.__version__}, CUDA {built}: {names}")
    yield from _cuda_python()


def _cuda_python() -> Iterator[Finding]:
    from weightstream.memory.gds import unavailable_reason

    try:
        from cuda.bindings import driver
    except ImportError as error:
        yield Finding(
            "cuda-python",
            PROBLEM,
            f"not importable ({error}): pinned memory, the staging ring and GDS need it: pip install "
            "'weightstream[cuda12]' (or [cuda13] for a CUDA 13 driver)",
        )
        return
    (status,) = driver.cuInit(0)
    error, version = driver.cuDriverGetVersion()
    installed = _version("cuda-bindings") or "?"
    if int(error) != 0 or int(status) != 0:
        yield Finding("cuda-python", PROBLEM, f"cuda-bindings {installed}, but the driver does not answer ({status})")
        return
    driver_major, bindings_major = version // 1000, release(installed)[0] if release(installed) else 0
    said = f"cuda-bindings {installed}, driver CUDA {driver_major}.{version % 1000 // 10}"
    if bindings_major > driver_major:
        yield Finding(
            "cuda-python",
            PROBLEM,
            f"{said}: bindings of CUDA {bindings_major} need a CUDA {bindings_major} driver; "
            f"pip install 'weightstream[cuda{driver_major}]'",
        )
        return
    yield Finding("cuda-python", OK, said)
    reason = unavailable_reason(need_nvidia_fs=True)
    yield Finding("gds", OK if reason is None else NOTE, reason or "cuFile opens and nvidia-fs is loaded")


def _direct_io(path: str) -> Iterator[Finding]:
    """Whether ``path`` (a file, or a directory) reads with O_DIRECT: an aligned 4 KiB read of that file, or of a
    file of the doctor's own made in that directory and removed (a checkpoint there is not read), else of the
    smallest file there when the directory cannot be written."""
    target = os.path.abspath(path)
    if not os.path.exists(target):
        yield Finding("o_direct", PROBLEM, f"{target}: no such file or directory")
        return
    if os.path.isfile(target):
        yield _read_direct(target)
        return
    try:
        descriptor, made = tempfile.mkstemp(prefix=".weightstream-doctor-", dir=target)
    except OSError as error:
        existing = _some_file(target)
        if existing is None:
            yield Finding("o_direct", NOTE, f"{target}: holds no file to read and none can be made ({error.strerror})")
        else:
            yield _read_direct(existing)
        return
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(b"\0" * ALIGNMENT)
        finding = _read_direct(made)
    finally:
        os.unlink(made)
    yield dataclasses.replace(finding, detail=finding.detail.replace(made, f"{target} (a file of its own there)"))


def _some_file(directory: str) -> str | None:
    with os.scandir(directory) as entries:
        files = [entry.path for entry in entries if entry.is_file() and entry.stat().st_size >= ALIGNMENT]
    return min(files, default=None)


def _read_direct(path: str) -> Finding:
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as error:
        return Finding(
            "o_direct",
            PROBLEM if error.errno == errno.EINVAL else NOTE,
            f"{path}: O_DIRECT refused ({error.strerror}): cold reads go through the page cache (slower, and they "
            "fill it)",
        )
    try:
        buffer = mmap.mmap(-1, ALIGNMENT)
        with buffer:
            os.preadv(descriptor, [buffer], 0)
    except OSError as error:
        return Finding("o_direct", PROBLEM, f"{path}: an aligned O_DIRECT read failed ({error.strerror})")
    finally:
        os.close(descriptor)
    return Finding("o_direct", OK, f"{path}: reads with O_DIRECT (cold loads bypass the page cache)")


def _huge_pages() -> Iterator[Finding]:
    from weightstream.nodecache.daemon.directory import default_directory
    from weightstream.nodecache.daemon.limits import tmpfs_huge_pages

    try:
        with open(THP_SETTING) as file:
            setting = file.read().strip()
    except OSError:
        setting = ""
    chosen = setting[setting.find("[") + 1 : setting.find("]")] if "[" in setting else setting or "unknown"
    yield Finding(
        "transparent_huge_pages",
        PROBLEM if chosen == "never" else OK,
        f"{chosen}" + (": loads fault 4 KiB pages (slower into fresh memory)" if chosen == "never" else ""),
    )
    directory = os.path.dirname(default_directory())
    huge = tmpfs_huge_pages(directory)
    yield Finding(
        "cache_tmpfs",
        OK if huge in ("always", "within_size", "advise") else NOTE,
        f"{directory}: "
        + (f"tmpfs huge={huge}" if huge else "not a tmpfs")
        + ("" if huge in ("always", "within_size", "advise") else ": the node cache's segments use 4 KiB pages"),
    )


def _libraries() -> Iterator[Finding]:
    for distribution, gives, extra in LIBRARIES:
        version = _version(distribution)
        if version is None:
            how = f"pip install 'weightstream[{extra}]'" if extra else "see docs/engines.md for its install"
            yield Finding(distribution, NOTE, f"not installed (for {gives}): {how}")
            continue
        minimum = MINIMUM_VERSIONS.get(distribution)
        if minimum is not None and release(version) < release(minimum):
            yield Finding(distribution, PROBLEM, f"{version}, older than the {minimum} {gives} needs")
        else:
            yield Finding(distribution, OK, f"{version} ({gives})")


def _credentials() -> Iterator[Finding]:
    for scheme, places in CREDENTIAL_PLACES.items():
        found = [where for kind, where in places if _present(kind, where)]
        if found:
            yield Finding(f"credentials {scheme}://", OK, "found in " + ", ".join(found) + " (not shown)")
        else:
            role = ", or an instance role found at run time" if scheme in ("s3", "gs", "az") else ""
            yield Finding(
                f"credentials {scheme}://",
                NOTE,
                f"none in the standard places (public data still reads; storage options can carry them{role})",
            )


def _present(kind: str, where: str) -> bool:
    if kind == "env":
        return bool(os.environ.get(where))
    home = os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface")
    docker = os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker")
    path = os.path.expanduser(where.replace("$HF_HOME", home).replace("$DOCKER_CONFIG", docker))
    return os.path.isfile(path)


def _cache_daemon() -> Iterator[Finding]:
    from weightstream.errors import CacheError
    from weightstream.nodecache.connection import find_daemon

    try:
        yield Finding("cache_daemon", OK, f"answers at {find_daemon('auto')}")
    except CacheError as error:
        yield Finding("cache_daemon", NOTE, f"{error} (cache='auto' reads from the source)")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
