"""The loaders a benchmark compares, each a generator of ``(name, tensor)`` over the same files.

Peers are imported only when measured; a peer that is not installed is reported as such.
The ``limit-*`` methods are not loaders: they measure what the machine allows.
"""

from __future__ import annotations

import contextlib
import importlib.util
import mmap
import os
from collections.abc import Callable, Iterator

import torch

from weightstream.memory.host import MADV_POPULATE_WRITE
from weightstream.sources.local.pagecache import BLOCK

Method = Callable[[str, list[str]], Iterator[tuple[str, torch.Tensor]]]


def weightstream_with(**options: object) -> Method:
    """weightstream.iter_weights with ``options`` (none: the defaults, owned memory)."""

    def load(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        import weightstream

        yield from weightstream.iter_weights(uri, **options)

    return load


def weightstream_dropping(**options: object) -> Method:
    """weightstream.iter_weights with ``options`` and a consumer that drops each tensor once the worker has
    touched it (``drops``), as an engine copying tensors into its parameters does: the run's peak RSS is then
    what the loader holds (the streaming window, the layered buffers), not the checkpoint."""
    load = weightstream_with(**options)
    load.drops = True
    return load


def weightstream_node_cache(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """weightstream.iter_weights through the node cache the bench started (``$WEIGHTSTREAM_CACHE``): views of its
    shared-memory segments, filled before the first round."""
    import weightstream

    yield from weightstream.iter_weights(uri, cache=os.environ["WEIGHTSTREAM_CACHE"])


def weightstream_ring_cpu(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The staging ring with the CPU copy engine: what a CUDA load does, minus the device (a diagnostic)."""
    import weightstream
    from weightstream.memory.ring import CpuStaging
    from weightstream.readers.staged import read_staged
    from weightstream.sources import store_for

    with weightstream.open(uri) as checkpoint, contextlib.closing(store_for(uri)) as store:
        yield from read_staged(store, checkpoint.plan, checkpoint.options, CpuStaging())


def safetensors_load_file(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """safetensors.torch.load_file per file: views of a file mapping (not owned memory)."""
    from safetensors.torch import load_file

    for path in files:
        yield from load_file(path).items()


def safetensors_safe_open(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """safetensors.safe_open + get_tensor, tensor by tensor."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt") as opened:
            for name in opened.keys():  # noqa: SIM118 - a file handle, not a dict: it has keys() and no __iter__
                yield name, opened.get_tensor(name)


def with_environment(method: Method, **variables: str) -> Method:
    """``method`` run with environment ``variables`` set first: how a peer's documented settings reach it (each
    measurement is a process of its own, and the peer reads them when it first streams)."""

    def load(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        os.environ.update(variables)
        yield from method(uri, files)

    return load


def safetensors_load_file_pread(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """safetensors.torch.load_file(backend="pread") per file: tensors read into memory of the process's own."""
    from safetensors.torch import load_file

    for path in files:
        yield from load_file(path, backend="pread").items()


def runai_model_streamer(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """runai-model-streamer's SafetensorsStreamer over all files in one request (its recommended use), settings from
    the environment (see :data:`SETTINGS`)."""
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files)
        yield from streamer.get_tensors()


def fastsafetensors_nogds(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """fastsafetensors without GDS to the CPU (its reads direct or buffered by ``FASTSAFETENSORS_ODIRECT``, default:
    direct on a local filesystem)."""
    from fastsafetensors import fastsafe_open

    with fastsafe_open(files, device="cpu", nogds=True) as opened:
        for name in opened.keys():  # noqa: SIM118 - a file handle, not a dict: it has keys() and no __iter__
            yield name, opened.get_tensor(name)


def limit_read_fresh(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The machine: one thread reads each whole file into freshly allocated (never touched) memory."""
    for path in files:
        buffer = bytearray(os.path.getsize(path))
        with open(path, "rb", buffering=0) as file:
            view, done = memoryview(buffer), 0
            while done < len(buffer):
                done += file.readinto(view[done:])
        yield path, torch.frombuffer(buffer, dtype=torch.uint8)


def limit_fresh_memory(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The machine: fault in fresh 4 KiB pages for as many bytes as the files hold, no I/O at all."""
    for path in files:
        mapping = mmap.mmap(-1, os.path.getsize(path), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(MADV_POPULATE_WRITE)
        yield path, torch.frombuffer(mapping, dtype=torch.uint8)


def limit_read_reused(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The machine: one sequential stream into one reused 16 MiB buffer (cold: the disk; warm: the copy)."""
    buffer = bytearray(BLOCK)
    for path in files:
        with open(path, "rb", buffering=0) as file:
            while file.readinto(buffer):
                pass
    yield from ()


def safetensors_load_file_cuda(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """safetensors.torch.load_file(device="cuda"): each tensor copied from the file mapping."""
    from safetensors.torch import load_file

    for path in files:
        yield from load_file(path, device="cuda:0").items()


def runai_model_streamer_cuda(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """runai-model-streamer to the GPU, default settings."""
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files, device="cuda:0")
        yield from streamer.get_tensors()


def fastsafetensors_cuda(nogds: bool) -> Method:
    """fastsafetensors to the GPU, with or without GPUDirect Storage, default settings otherwise."""

    def load(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        from fastsafetensors import fastsafe_open

        with fastsafe_open(files, device="cuda:0", nogds=nogds) as opened:
            for name in opened.keys():  # noqa: SIM118 - a file handle, not a dict: it has keys() and no __iter__
                yield name, opened.get_tensor(name)

    return load


def instanttensor_cuda(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """InstantTensor's safe_open over all files at once (its recommended use), default settings."""
    from instanttensor import safe_open

    with safe_open(files, framework="pt", device=0) as opened:
        yield from opened.tensors()


def limit_h2d_pinned(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The machine: copy as many bytes as the files hold from one pinned 256 MiB buffer into fresh
    device memory (the pinned host-to-device rate, no storage involved)."""
    total = sum(os.path.getsize(path) for path in files)
    staging = torch.empty(H2D_BLOCK, dtype=torch.uint8, pin_memory=True)
    destination = torch.empty(total, dtype=torch.uint8, device="cuda:0")
    for start in range(0, total, H2D_BLOCK):
        end = min(start + H2D_BLOCK, total)
        destination[start:end].copy_(staging[: end - start], non_blocking=True)
    torch.cuda.synchronize()
    yield "h2d", destination


H2D_BLOCK = 256 << 20

CUDA_METHODS: dict[str, tuple[Method, str | None]] = {
    "weightstream": (weightstream_with(device="cuda:0"), None),
    "weightstream-small-ring": (weightstream_with(device="cuda:0", staging_slots=4, staging_slot_bytes=4 << 20), None),
    "weightstream-gds": (weightstream_with(device="cuda:0", gds=True), None),
    "weightstream-layered": (weightstream_dropping(device="cuda:0", format="layered"), None),
    "safetensors.load_file": (safetensors_load_file_cuda, "safetensors"),
    "runai-model-streamer": (runai_model_streamer_cuda, "runai_model_streamer"),
    "fastsafetensors-nogds": (fastsafetensors_cuda(nogds=True), "fastsafetensors"),
    "fastsafetensors-gds": (fastsafetensors_cuda(nogds=False), "fastsafetensors"),
    "instanttensor": (instanttensor_cuda, "instanttensor"),
    "limit-h2d-pinned": (limit_h2d_pinned, None),
    "limit-read-reused": (limit_read_reused, None),
}
"""``bench --device cuda``: name -> (generator landing tensors on cuda:0, the module it needs)."""

METHODS: dict[str, tuple[Method, str | None]] = {
    "weightstream": (weightstream_with(), None),
    # What each default is worth: transparent huge pages, direct reads when cold, owned memory.
    "weightstream-4k-pages": (weightstream_with(huge_pages=False), None),
    "weightstream-buffered": (weightstream_with(direct_io=False), None),
    "weightstream-zero-copy": (weightstream_with(zero_copy=True), None),
    "weightstream-ring-cpu": (weightstream_ring_cpu, None),
    "weightstream-layered": (weightstream_dropping(format="layered"), None),
    "weightstream-node-cache": (weightstream_node_cache, None),
    # A sharded-state directory (weightstream convert): rank 0's files, unverified and verified.
    "weightstream-rank0": (weightstream_with(format="sharded-state", rank=0), None),
    "weightstream-rank0-verify": (weightstream_with(format="sharded-state", rank=0, verify=True), None),
    "safetensors.load_file": (safetensors_load_file, "safetensors"),
    "safetensors.load_file-pread": (safetensors_load_file_pread, "safetensors"),
    "safetensors.safe_open": (safetensors_safe_open, "safetensors"),
    "runai-model-streamer": (runai_model_streamer, "runai_model_streamer"),
    "runai-model-streamer-c4": (
        with_environment(runai_model_streamer, RUNAI_STREAMER_CONCURRENCY="4"),
        "runai_model_streamer",
    ),
    "runai-model-streamer-c32-unlimited": (
        with_environment(runai_model_streamer, RUNAI_STREAMER_CONCURRENCY="32", RUNAI_STREAMER_MEMORY_LIMIT="-1"),
        "runai_model_streamer",
    ),
    "fastsafetensors": (fastsafetensors_nogds, "fastsafetensors"),
    "fastsafetensors-buffered": (
        with_environment(fastsafetensors_nogds, FASTSAFETENSORS_ODIRECT="0"),
        "fastsafetensors",
    ),
    "limit-read-fresh": (limit_read_fresh, None),
    "limit-read-reused": (limit_read_reused, None),
    "limit-fresh-memory": (limit_fresh_memory, None),
}
"""Name -> (generator, the module it needs)."""

SETTINGS: dict[str, str] = {
    "weightstream": "defaults: direct reads into huge pages when cold, buffered reads when warm",
    "weightstream-4k-pages": "huge_pages=False",
    "weightstream-buffered": "direct_io=False",
    "weightstream-zero-copy": "zero_copy=True",
    "safetensors.load_file": "backend='mmap' (its default)",
    "safetensors.load_file-pread": "backend='pread'",
    "safetensors.safe_open": "framework='pt', get_tensor per name",
    "runai-model-streamer": "its defaults: CONCURRENCY 16, MEMORY_LIMIT 40 GB, buffered reads",
    "runai-model-streamer-c4": "RUNAI_STREAMER_CONCURRENCY=4 (2 CPUs: fewer readers)",
    "runai-model-streamer-c32-unlimited": "RUNAI_STREAMER_CONCURRENCY=32, RUNAI_STREAMER_MEMORY_LIMIT=-1 (unlimited)",
    "fastsafetensors": "nogds=True, its default O_DIRECT on a local filesystem",
    "fastsafetensors-buffered": "nogds=True, FASTSAFETENSORS_ODIRECT=0 (buffered reads)",
    "limit-read-fresh": "one thread, readinto fresh memory",
    "limit-read-reused": "one thread, 16 MiB buffer reused",
    "limit-fresh-memory": "MADV_POPULATE_WRITE on anonymous memory, no I/O",
}
"""Each CPU method's settings as the bench runs it, stated beside its figure (``bench`` table and ``--json``). Peers
run as their documentation recommends (runai: one ``stream_files`` request over all files; fastsafetensors:
``fastsafe_open`` over all files), their variables named where the bench sets them."""


METHODS_BY_DEVICE = {"cpu": METHODS, "cuda": CUDA_METHODS}

NODE_CACHE_METHODS = frozenset({"weightstream-node-cache"})
"""Methods that read through a cache daemon, which the bench starts (and fills) for them."""

MAPPED_METHODS = frozenset(
    {"safetensors.load_file", "safetensors.safe_open", "weightstream-zero-copy", "weightstream-node-cache"}
)
"""CPU methods whose tensors are views of a mapping (the file's page cache, the cache daemon's shared memory), not
memory of the process's own: warm, they measure mapping pages, not copying bytes."""


def memory_of(method: str, device: str = "cpu") -> str:
    """Where ``method``'s tensors live: ``device``, ``mapped`` (views of shared pages) or ``owned``.

    Example:
        >>> memory_of("safetensors.load_file"), memory_of("weightstream"), memory_of("weightstream", "cuda")
        ('mapped', 'owned', 'device')
    """
    if device != "cpu":
        return "device"
    return "mapped" if method in MAPPED_METHODS else "owned"


SHARDED_STATE_METHODS = frozenset({"weightstream-rank0", "weightstream-rank0-verify"})
"""Methods that read a sharded-state directory (benchmarks/sharded_state_bench.py): run only when named."""

PEER_VARIANTS = frozenset(
    {
        "safetensors.load_file-pread",
        "runai-model-streamer-c4",
        "runai-model-streamer-c32-unlimited",
        "fastsafetensors-buffered",
    }
)
"""Peers under their other documented settings (benchmarks/README.md's figures run names them): run only when
named, so the demo measures each peer once, at its defaults."""

RUN_WHEN_NAMED = SHARDED_STATE_METHODS | PEER_VARIANTS
"""Methods a bench without ``--methods`` leaves out."""


def missing_module(method: str, device: str = "cpu") -> str | None:
    """The module ``method`` needs that is not installed, if any."""
    module = METHODS_BY_DEVICE[device][method][1]
    return module if module is not None and importlib.util.find_spec(module) is None else None
