"""What ``weightstream bench s3://...`` (or ``gs://``, ``http(s)://``) compares, each a generator of
``(name, tensor)`` over the same objects, run in a fresh process with the endpoint and keys in
the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ..., ``STORAGE_EMULATOR_HOST``).

The ``limit-*`` methods are not loaders: they read every byte and keep none (each answer goes
into one reused buffer), so they measure what the server and the connection give, not what
landing the bytes in fresh memory costs.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from weightstream.bench.methods import Method, weightstream_dropping, weightstream_with

LIMIT_RANGE_BYTES = 64 << 20
"""Range size of the concurrent ``limit-*`` readers (the size the team's server survey used)."""
LIMIT_THREADS = 16
PIECE = 8 << 20


@dataclasses.dataclass(frozen=True)
class RemoteMethod:
    """A remote benchmark method: its generator, the module it needs (or, by scheme, the modules), and the URI
    schemes it reads."""

    load: Method
    module: str | Mapping[str, str] | None
    schemes: tuple[str, ...] = ("s3", "gs", "http", "https", "az", "oci")


def runai_streamer(concurrency: int | None) -> Method:
    """runai-model-streamer's SafetensorsStreamer from the object store (``concurrency`` None: its default). On
    Azure it takes ``AZURE_STORAGE_ACCOUNT_NAME`` and ``AZURE_STORAGE_ACCOUNT_KEY`` (set here from the connection
    string) and reaches ``https://ACCOUNT.blob.<suffix>`` only: an emulator's path-style endpoint it cannot."""

    def load(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        if concurrency is not None:
            os.environ["RUNAI_STREAMER_CONCURRENCY"] = str(concurrency)
        if uri.startswith("az://") and os.environ.get("AZURE_STORAGE_CONNECTION_STRING"):
            fields = dict(
                part.split("=", 1) for part in os.environ["AZURE_STORAGE_CONNECTION_STRING"].split(";") if "=" in part
            )
            os.environ.setdefault("AZURE_STORAGE_ACCOUNT_NAME", fields.get("AccountName", ""))
            os.environ.setdefault("AZURE_STORAGE_ACCOUNT_KEY", fields.get("AccountKey", ""))
        os.environ.setdefault("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")  # path-style, as local servers want
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files)
            yield from streamer.get_tensors()

    return load


def fsspec_sequential(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Plain fsspec (s3fs, gcsfs; not weightstream's extras, which read S3 through botocore): open each object
    and read it whole into fresh memory, 64 MiB blocks."""
    import fsspec.core

    fs, _ = fsspec.core.url_to_fs(files[0])
    for path in files:
        with fs.open(path, "rb", block_size=64 << 20) as file:
            buffer = bytearray(file.size)
            file.readinto(buffer)
        yield path, torch.frombuffer(buffer, dtype=torch.uint8)


def limit_boto3_get(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The server: one plain boto3 GET per object, its body read in 8 MiB pieces and dropped."""
    import boto3

    client = boto3.client("s3")
    for path in files:
        bucket, key = _bucket_and_key(path)
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        while body.read(PIECE):
            pass
    yield from ()


def boto3_ranges(keep: bool) -> Method:
    """16 concurrent boto3 range GETs of 64 MiB; with ``keep`` each body is kept (fresh memory, like a
    loader's), else read in 8 MiB pieces and dropped (the server's rate)."""

    def load(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        import boto3
        import botocore.config

        client = boto3.client("s3", config=botocore.config.Config(max_pool_connections=LIMIT_THREADS))

        def get(job: tuple[str, str, int, int]) -> bytes | None:
            bucket, key, start, end = job
            body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"]
            if keep:
                return body.read()
            while body.read(PIECE):
                pass
            return None

        jobs = []
        for path in files:
            bucket, key = _bucket_and_key(path)
            size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
            jobs += [(bucket, key, start, end) for start, end in _spans(size, LIMIT_RANGE_BYTES)]
        with ThreadPoolExecutor(LIMIT_THREADS) as pool:
            bodies = list(pool.map(get, jobs))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # bytes are read-only; these tensors are only measured
            for number, body in enumerate(bodies if keep else ()):
                yield str(number), torch.frombuffer(body, dtype=torch.uint8)

    return load


def limit_transport(threads: int, range_bytes: int) -> Method:
    """Our range client alone: ``threads`` concurrent range GETs, each thread reading into one reused buffer."""

    def load(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        import contextlib

        from weightstream.sources import store_for

        local = threading.local()
        with contextlib.closing(store_for(uri)) as store:
            sources = [store.open(path) for path in files]

            def get(job: tuple[int, int, int]) -> None:
                number, start, end = job
                if getattr(local, "buffer", None) is None:
                    local.buffer = memoryview(bytearray(range_bytes))
                sources[number].read_into(start, local.buffer[: end - start])

            jobs = [
                (number, start, end)
                for number, source in enumerate(sources)
                for start, end in _spans(source.size, range_bytes)
            ]
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(get, jobs))
        yield from ()

    return load


def limit_obstore_ranges(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """obstore (Rust, object_store) as the transport: 16 concurrent async range GETs of 64 MiB, dropped."""
    import asyncio

    import obstore
    from obstore.store import from_url

    bucket_url = "/".join(uri.split("/", 3)[:3])
    store = from_url(bucket_url, client_options={"allow_http": True})

    async def fetch() -> None:
        limit = asyncio.Semaphore(LIMIT_THREADS)

        async def get(key: str, start: int, end: int) -> None:
            async with limit:
                await obstore.get_range_async(store, key, start=start, end=end)

        jobs = []
        for path in files:
            key = _bucket_and_key(path)[1]
            size = (await obstore.head_async(store, key))["size"]
            jobs += [get(key, start, end) for start, end in _spans(size, LIMIT_RANGE_BYTES)]
        await asyncio.gather(*jobs)

    asyncio.run(fetch())
    yield from ()


def limit_azure_download(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The server, through Azure's own client: ``download_blob(max_concurrency=16)`` of each blob, read into one
    reused buffer (``AZURE_STORAGE_CONNECTION_STRING``)."""
    from azure.storage.blob import BlobServiceClient

    with BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"]) as service:
        buffer = bytearray()
        for path in files:
            container, blob = _bucket_and_key(path)
            download = service.get_blob_client(container, blob).download_blob(max_concurrency=LIMIT_THREADS)
            if len(buffer) < download.size:
                buffer = bytearray(download.size)
            download.readinto(_Into(memoryview(buffer)))
    yield from ()


class _Into(io.RawIOBase):
    """A seekable stream writing into an existing buffer (what a parallel ``download_blob`` writes to)."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._at = view, 0

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._at = offset if whence == io.SEEK_SET else self._at + offset
        return self._at

    def tell(self) -> int:
        return self._at

    def write(self, data) -> int:  # type: ignore[no-untyped-def,override]
        self._view[self._at : self._at + len(data)] = data
        self._at += len(data)
        return len(data)


def limit_oci_ranges(uri: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The registry: 16 concurrent plain range GETs of 64 MiB on each file's blob (no hashing), read into reused
    buffers; the blobs found through weightstream's manifest resolution."""
    import contextlib
    import http.client
    import urllib.parse

    from weightstream.sources.oci.store import OciStore

    with contextlib.closing(OciStore()) as store:
        sources = [store.open(path) for path in files]
        blobs = {(store.range_target(source).url, source.file.blob_size) for source in sources}
    local = threading.local()

    def get(job: tuple[str, int, int]) -> None:
        url, start, end = job
        parts = urllib.parse.urlsplit(url)
        if getattr(local, "connection", None) is None:
            local.connection = http.client.HTTPConnection(parts.netloc, timeout=60)
            local.buffer = memoryview(bytearray(LIMIT_RANGE_BYTES))
        local.connection.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""),
                                 headers={"Range": f"bytes={start}-{end - 1}"})  # fmt: skip
        answer = local.connection.getresponse()
        view, got = local.buffer[: end - start], 0
        while got < end - start:
            count = answer.readinto(view[got:])
            if not count:
                raise OSError(f"{url}: short answer after {got} of {end - start} bytes")
            got += count

    jobs = [(url, start, end) for url, size in blobs for start, end in _spans(size, LIMIT_RANGE_BYTES)]
    with ThreadPoolExecutor(LIMIT_THREADS) as pool:
        list(pool.map(get, jobs))
    yield from ()


def _bucket_and_key(path: str) -> tuple[str, str]:
    """``s3://bucket/key/of/object`` -> ``("bucket", "key/of/object")``."""
    bucket, key = path.split("://", 1)[1].split("/", 1)
    return bucket, key


def _spans(size: int, step: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of ``step`` bytes (the last one shorter) covering ``size`` bytes."""
    return [(start, min(size, start + step)) for start in range(0, size, step)]


REMOTE_METHODS: dict[str, RemoteMethod] = {
    "weightstream": RemoteMethod(weightstream_with(), None),
    "weightstream-16-threads": RemoteMethod(weightstream_with(threads=16), None),
    "weightstream-32mib-requests": RemoteMethod(weightstream_with(chunk_bytes=32 << 20), None),
    "weightstream-safetensors": RemoteMethod(weightstream_with(format="safetensors"), None),
    "weightstream-256mib-dropped": RemoteMethod(weightstream_dropping(max_inflight_bytes=256 << 20), None),
    "weightstream-layered": RemoteMethod(weightstream_dropping(format="layered"), None),
    "runai-model-streamer": RemoteMethod(runai_streamer(None), "runai_model_streamer", ("s3", "gs", "az")),
    "runai-model-streamer-c16": RemoteMethod(runai_streamer(16), "runai_model_streamer", ("s3", "gs", "az")),
    "runai-model-streamer-c32": RemoteMethod(runai_streamer(32), "runai_model_streamer", ("s3", "gs", "az")),
    "fsspec-sequential": RemoteMethod(fsspec_sequential, {"s3": "s3fs", "gs": "gcsfs"}, ("s3", "gs")),
    "limit-boto3-get": RemoteMethod(limit_boto3_get, "boto3", ("s3",)),
    "limit-boto3-16-ranges": RemoteMethod(boto3_ranges(keep=False), "boto3", ("s3",)),
    "boto3-16-ranges-kept": RemoteMethod(boto3_ranges(keep=True), "boto3", ("s3",)),
    "limit-transport-8-ranges": RemoteMethod(limit_transport(8, PIECE), None, ("s3", "gs", "http", "https", "az")),
    "limit-azure-download-16": RemoteMethod(limit_azure_download, "azure.storage.blob", ("az",)),
    "limit-oci-16-ranges": RemoteMethod(limit_oci_ranges, None, ("oci",)),
    "limit-obstore-16-ranges": RemoteMethod(limit_obstore_ranges, "obstore", ("s3",)),
}
"""Name -> method, for checkpoints in object stores (and over HTTP)."""


def remote_skip_reason(method: str, uri: str) -> str | None:
    """Why ``method`` cannot run on ``uri`` here (a module missing, a scheme it does not read), or None."""
    import importlib.util

    entry = REMOTE_METHODS[method]
    scheme = uri.split("://", 1)[0]
    if scheme not in entry.schemes:
        return f"does not read {scheme}:// URIs"
    module = entry.module.get(scheme) if isinstance(entry.module, Mapping) else entry.module
    if module is not None and importlib.util.find_spec(module) is None:
        return f"{module} is not installed"
    return None
