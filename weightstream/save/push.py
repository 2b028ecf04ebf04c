"""``weightstream push DIR oci://registry/repository:tag``: a checkpoint directory as a ModelPack artifact.

One raw layer per file (``application/vnd.cncf.model.weight.v1.raw`` for weights,
``...weight.config.v1.raw`` for the JSON and tokenizer files beside them), each named by its
``org.cncf.model.filepath`` annotation; a ModelPack config (``application/vnd.cncf.model.config.v1+json``)
listing the layers' digests; an OCI image manifest with ``artifactType``
``application/vnd.cncf.model.manifest.v1+json``, put under the tag last, so a tag never names an artifact
whose blobs are not all there. Blobs the registry already holds are not sent again. Each blob is hashed
before it is sent and streamed from its file (the registry checks the digest it is told).
"""

from __future__ import annotations

import datetime
import hashlib
import http.client
import json
import os
import urllib.parse
from collections.abc import Callable
from typing import Any, BinaryIO

from weightstream.errors import SaveError, SourceError
from weightstream.formats import oci
from weightstream.sources.local.regular import open_regular
from weightstream.sources.oci.auth import RegistryAuth
from weightstream.sources.oci.store import OciStore

WEIGHT = "application/vnd.cncf.model.weight.v1.raw"
WEIGHT_CONFIG = "application/vnd.cncf.model.weight.config.v1.raw"
MODEL_CONFIG = "application/vnd.cncf.model.config.v1+json"
ARTIFACT_TYPE = "application/vnd.cncf.model.manifest.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SEND_BLOCK_BYTES = 1 << 20
Body = Any
"""A request body: bytes, a file, or a file that reports its reads (http.client streams the last two)."""


def push(
    directory: str,
    uri: str,
    storage_options: dict[str, object] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, object]:
    """Upload every file under ``directory`` as the ModelPack artifact ``uri`` names (a tag); what was pushed.

    Raises:
        SaveError: the directory holds no file, or the registry refused an upload.
        UnsupportedInputError, NotFound: a FIFO, device, socket or dangling link among the files (before any upload).
        AccessDeniedError: the registry refused the credentials.

    Example:
        >>> push("llama/", "oci://127.0.0.1:5000/models/llama:v1")  # doctest: +SKIP
        {'uri': 'oci://127.0.0.1:5000/models/llama:v1', 'digest': 'sha256:...', 'files': 3, 'bytes': 2470051840, ...}
    """
    reference = oci.parse_reference(uri)
    if reference.tag is None or reference.path:
        raise SaveError(f"{uri}: push to a tag (oci://registry/repository:tag), not a digest or a path")
    paths = sorted(
        os.path.relpath(os.path.join(root, name), directory)
        for root, _, names in os.walk(directory)
        for name in names
        if not name.startswith(".")
    )
    if not paths:
        raise SaveError(f"{directory}: no files to push")
    for path in paths:  # a FIFO, a device, a socket or a dangling link is refused before anything is sent
        fd, _ = open_regular(os.path.join(directory, path))
        os.close(fd)
    store = OciStore(storage_options)
    try:
        pusher = _Pusher(store, reference, RegistryAuth.of(reference, storage_options or {}, "pull,push"))
        layers, sent = [], 0
        for path in paths:
            full = os.path.join(directory, path)
            digest, size = _file_digest(full)
            sent += pusher.blob_from_file(full, digest, size, progress)
            layers.append(
                {
                    "mediaType": WEIGHT if path.endswith(WEIGHT_SUFFIXES) else WEIGHT_CONFIG,
                    "digest": digest,
                    "size": size,
                    "annotations": {"org.cncf.model.filepath": path, "org.opencontainers.image.title": path},
                }
            )
        config = json.dumps(
            {
                "descriptor": {
                    "createdAt": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "name": reference.repository.rsplit("/", 1)[-1],
                    "version": reference.tag,
                },
                "config": {},
                "modelfs": {"type": "layers", "diffIds": [layer["digest"] for layer in layers]},
            },
            sort_keys=True,
        ).encode()
        config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
        pusher.blob_from_bytes(config, config_digest)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": MANIFEST,
                "artifactType": ARTIFACT_TYPE,
                "config": {"mediaType": MODEL_CONFIG, "digest": config_digest, "size": len(config)},
                "layers": layers,
            },
            sort_keys=True,
        ).encode()
        digest = pusher.manifest(manifest)
    finally:
        store.close()
    total = sum(layer["size"] for layer in layers)  # type: ignore[misc]
    return {"uri": uri, "digest": digest, "files": len(layers), "bytes": total, "bytes_sent": sent}


class _Pusher:
    """Uploads to one repository, answering the registry's 401 challenges with ``auth``."""

    def __init__(self, store: OciStore, reference: oci.Reference, auth: RegistryAuth) -> None:
        self.store, self.reference, self.auth = store, reference, auth
        self.base = store.repository_url(reference)

    def blob_from_file(self, path: str, digest: str, size: int, progress: Callable[[int], None] | None) -> int:
        """Upload ``path`` as blob ``digest`` unless the registry holds it; the bytes sent."""
        if self._exists(digest):
            if progress is not None:
                progress(size)
            return 0
        fd, _ = open_regular(path)
        with os.fdopen(fd, "rb") as body:
            self._upload(digest, size, body, progress)
        return size

    def blob_from_bytes(self, data: bytes, digest: str) -> None:
        if not self._exists(digest):
            self._upload(digest, len(data), data, None)

    def manifest(self, body: bytes) -> str:
        """Put the manifest under the tag; its digest."""
        url = f"{self.base}/manifests/{self.reference.tag}"
        answer, text = self._request("PUT", url, {"Content-Type": MANIFEST}, body)
        if answer.status not in (200, 201):
            raise SaveError(
                f"{self.reference.artifact}: the registry refused the manifest: HTTP {answer.status} {text}"
            )
        return "sha256:" + hashlib.sha256(body).hexdigest()

    def _exists(self, digest: str) -> bool:
        answer, _ = self._request("HEAD", f"{self.base}/blobs/{digest}", {}, None)
        return answer.status == 200

    def _upload(self, digest: str, size: int, body: Body, progress: Callable[[int], None] | None) -> None:
        answer, text = self._request("POST", f"{self.base}/blobs/uploads/", {"Content-Length": "0"}, b"")
        if answer.status != 202 or not answer.getheader("Location"):
            raise SaveError(f"{self.reference.artifact}: the registry refused an upload: HTTP {answer.status} {text}")
        location = urllib.parse.urljoin(self.base + "/", answer.getheader("Location"))
        url = f"{location}{'&' if '?' in location else '?'}{urllib.parse.urlencode({'digest': digest})}"
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        answer, text = self._request("PUT", url, headers, _Counted(body, progress) if progress else body)
        if answer.status != 201:
            raise SaveError(
                f"{self.reference.artifact}: the registry refused blob {digest} ({size} bytes): HTTP {answer.status} "
                f"{text}"
            )

    def _request(
        self, method: str, url: str, headers: dict[str, str], body: Body
    ) -> tuple[http.client.HTTPResponse, str]:
        """One request, and once more after answering a 401 challenge (never for a streamed body: uploads start
        with a POST, which meets the challenge first)."""
        return self.auth.send(
            lambda sent: _send(method, url, {**headers, **sent}, body),
            self.store.fetch,
            url,
            repeatable=not hasattr(body, "read"),
        )


class _Counted:
    """A file body that reports the bytes read from it (http.client reads it in blocks)."""

    def __init__(self, body: BinaryIO, progress: Callable[[int], None]) -> None:
        self._body, self._progress = body, progress

    def read(self, nbytes: int = -1) -> bytes:
        data = self._body.read(nbytes)
        self._progress(len(data))
        return data


def _send(method: str, url: str, headers: dict[str, str], body: Body) -> tuple[http.client.HTTPResponse, str]:
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.netloc, timeout=300, blocksize=SEND_BLOCK_BYTES)
    try:
        connection.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), body=body, headers=headers)
        answer = connection.getresponse()
        text = answer.read(2048).decode("utf-8", "replace") if method != "HEAD" else ""
        return answer, text
    except OSError as error:
        raise SourceError(f"{url}: {type(error).__name__}: {error}") from None
    finally:
        connection.close()


def _file_digest(path: str) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    fd, _ = open_regular(path)
    with os.fdopen(fd, "rb") as file:
        while chunk := file.read(8 << 20):
            digest.update(chunk)
            size += len(chunk)
    return "sha256:" + digest.hexdigest(), size
