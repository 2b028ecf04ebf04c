"""Shared fixtures: checkpoints written by the real `safetensors` package, and leak checks."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import shutil
import struct
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightstream.bench.demo import LlamaShape, llama_state_dict

TINY_LLAMA = LlamaShape(hidden=64, intermediate=160, layers=3, vocab=96)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker gets a temporary directory of its own (``TMPDIR``, inherited by the
    servers and engines it starts), so that ``no_leaks`` sees only what this worker's tests leave behind."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        private = tempfile.mkdtemp(prefix=f"weightstream-tests-{worker}-")
        os.environ["TMPDIR"] = tempfile.tempdir = private
        config.add_cleanup(lambda: shutil.rmtree(private, ignore_errors=True))


@pytest.fixture
def tiny_state() -> dict[str, torch.Tensor]:
    return llama_state_dict(TINY_LLAMA, seed=1)


def save_hf_sharded(state: dict[str, torch.Tensor], directory: Path, shards: int) -> Path:
    """The Hugging Face sharded layout, written by the `safetensors` package itself."""
    directory.mkdir(parents=True, exist_ok=True)
    names = list(state)
    weight_map = {}
    for number in range(shards):
        part = names[number::shards]
        file_name = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        save_file({name: state[name] for name in part}, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def raw_file(path: Path, header: object, data: bytes = b"", *, length: int | None = None) -> Path:
    """A file with an arbitrary header (a JSON-able object or raw bytes) and data section."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@dataclasses.dataclass(frozen=True)
class Destination:
    """Where a test asks tensors to land, and what it then checks of them."""

    name: str
    options: dict
    device_type: str = "cpu"
    pinned: bool = False


CPU = Destination("cpu", {})
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
_NO_PINNING = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cuda.bindings") is None,
    reason="needs CUDA and cuda-python",
)
DESTINATIONS = [
    pytest.param(CPU, id="cpu"),
    pytest.param(
        Destination("pinned", {"pin_memory": True}, pinned=True), id="pinned", marks=[pytest.mark.cuda, _NO_PINNING]
    ),
    pytest.param(Destination("cuda", {"device": "cuda"}, "cuda"), id="cuda", marks=[pytest.mark.cuda, _NO_CUDA]),
    pytest.param(
        Destination("cuda-small-ring", {"device": "cuda:0", "staging_slots": 2, "staging_slot_bytes": 8192}, "cuda"),
        id="cuda-small-ring",
        marks=[pytest.mark.cuda, _NO_CUDA],
    ),
    pytest.param(
        Destination("cuda-gds-auto", {"device": "cuda", "gds": "auto"}, "cuda"),
        id="cuda-gds-auto",
        marks=[pytest.mark.cuda, _NO_CUDA],
    ),
]
"""Every destination the loaders offer; GPU ones skip themselves without CUDA and run the same checks with it."""


@pytest.fixture(params=DESTINATIONS)
def destination(request) -> Destination:
    return request.param


def assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], on: Destination = CPU) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        got = loaded[name]
        assert got.dtype == tensor.dtype, name
        assert got.shape == tensor.shape, name
        assert got.device.type == on.device_type, name
        if on.pinned and tensor.numel():
            assert got.is_pinned(), f"{name} is not in pinned memory"
        got = got.cpu()
        if tensor.numel():
            assert bytes(got.contiguous().view(-1).view(torch.uint8).numpy()) == bytes(
                tensor.contiguous().view(-1).view(torch.uint8).numpy()
            ), name


def truncating_after_first_read(paths: list[Path]):
    """A ``progress`` callback that truncates ``paths`` to one page when the first read lands."""
    truncated = threading.Event()

    def truncate(nbytes: int) -> None:
        if not truncated.is_set():
            truncated.set()
            for path in paths:
                os.truncate(path, 4096)

    return truncate


def snapshot() -> tuple[set[int], set[str]]:
    gc.collect()
    threads = {thread.ident for thread in threading.enumerate()}
    fds = set(os.listdir("/proc/self/fd"))
    return threads, fds


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves threads, file descriptors or temporary files behind."""
    threads_before, fds_before = snapshot()
    temp_before = set(os.listdir(tempfile.gettempdir()))
    yield
    threads_after, fds_after = snapshot()
    deadline = time.monotonic() + 2
    while (fds_after - fds_before or threads_after - threads_before) and time.monotonic() < deadline:
        time.sleep(0.05)  # event loops (the fault proxy's, fsspec's) close their sockets one iteration later
        threads_after, fds_after = snapshot()
    leaked_threads = [t.name for t in threading.enumerate() if t.ident in threads_after - threads_before]
    assert not leaked_threads, f"threads leaked: {leaked_threads}"
    leaked_fds = {fd: _fd_target(fd) for fd in fds_after - fds_before}
    leaked_fds = {fd: target for fd, target in leaked_fds.items() if target is not None}
    assert not leaked_fds, f"file descriptors leaked: {leaked_fds}; sockets: {_sockets(leaked_fds)}"
    stray = set(os.listdir(tempfile.gettempdir())) - temp_before
    assert not stray, f"temporary files left behind: {sorted(stray)}"


def _sockets(fds: dict[str, str]) -> list[str]:
    import psutil

    return [f"{c.laddr} -> {c.raddr} {c.status}" for c in psutil.Process().net_connections() if str(c.fd) in fds]


def _fd_target(fd: str) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:  # the fd listdir itself used
        return None


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A real SeaweedFS for the session: (S3 endpoint, HTTP URL of its filer's view of the bucket),
    the S3 endpoint reached through the standard AWS variables."""
    from tests.objstore import KEYS, seaweedfs

    with (
        seaweedfs(tmp_path_factory.mktemp("s3")) as (endpoint, filer),
        _environment({**KEYS, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}),
    ):
        yield endpoint, filer


@pytest.fixture(scope="session")
def s3_endpoint(seaweed):
    """A real S3 server (SeaweedFS) for the session."""
    return seaweed[0]


@pytest.fixture(scope="session")
def http_base(seaweed):
    """The bucket of the S3 server, served over plain HTTP by SeaweedFS's filer."""
    return seaweed[1]


@pytest.fixture(scope="session")
def gcs_endpoint(tmp_path_factory):
    """A GCS emulator (fake-gcs-server) for the session, reached through STORAGE_EMULATOR_HOST."""
    import fsspec.asyn

    from tests.objstore import fake_gcs

    # fsspec's one IO thread lives as long as the process: started here, not counted as a load's leak
    fsspec.asyn.get_loop()
    with (
        fake_gcs(tmp_path_factory.mktemp("gcs")) as endpoint,
        _environment(
            {
                "STORAGE_EMULATOR_HOST": endpoint,
                "FSSPEC_GCS_TOKEN": "anon",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            }
        ),
    ):
        yield endpoint


@pytest.fixture(scope="session")
def azure_endpoint(tmp_path_factory):
    """An Azure Blob emulator (Azurite) for the session, reached through AZURE_STORAGE_CONNECTION_STRING."""
    import fsspec.asyn

    from tests.objstore import azure_connection_string, azurite

    # fsspec's one IO thread lives as long as the process: not a load's leak. So do the threads of its loop's
    # executor, where aiohttp (under adlfs) looks up netrc and proxy settings for each request: made here.
    loop = fsspec.asyn.get_loop()
    fsspec.asyn.sync(loop, _fill_executor, loop)
    with (
        azurite(tmp_path_factory.mktemp("azure")) as endpoint,
        _environment({"AZURE_STORAGE_CONNECTION_STRING": azure_connection_string(endpoint)}),
    ):
        yield endpoint


@pytest.fixture(scope="session")
def oci_address(tmp_path_factory) -> str:
    """A CNCF distribution registry (Debian's docker-registry) for the session: its ``127.0.0.1:PORT``."""
    from tests.objstore import oci_registry

    with oci_registry(tmp_path_factory.mktemp("registry")) as address:
        yield address


async def _fill_executor(loop) -> None:
    import asyncio

    await asyncio.gather(*(loop.run_in_executor(None, time.sleep, 0.05) for _ in range(16)))


ENDPOINTS = {"s3": "s3_endpoint", "gs": "gcs_endpoint", "az": "azure_endpoint"}


@pytest.fixture(params=list(ENDPOINTS))
def scheme(request) -> str:
    """Each object store, its server started once per session."""
    request.getfixturevalue(ENDPOINTS[request.param])
    return request.param


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
