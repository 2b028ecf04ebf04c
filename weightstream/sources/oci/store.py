"""Checkpoints in OCI registries (``oci://registry[:port]/repository:tag`` or ``@sha256:...``), read in place.

At plan time the reference is resolved once to a manifest digest (an index to the manifest it lists), and the
artifact's files are found in its layers (``weightstream.formats.oci``): a raw layer is one file, an
uncompressed tar layer's members are found by reading their headers with small ranges. Every later read goes
to a blob by digest, so a tag moved mid-load changes nothing. Bytes come from range GETs of
``/v2/<repository>/blobs/<digest>`` through the range client of every remote store, following the registry's
redirect to object storage (credentials never go to the redirect's host; an expired redirect is asked for
again and the range resumes).

Auth: anonymous, basic, or the bearer-token flow (``WWW-Authenticate: Bearer realm=...``): credentials from
``storage_options`` (``username``, ``password``) or the Docker config file (``$DOCKER_CONFIG/config.json`` or
``~/.docker/config.json``, its ``auths``) (``weightstream.sources.oci.auth``). A token that expires (a 401
mid-load) is asked for again and the range retried.

Integrity: each blob's bytes are hashed (sha256) in blob order as they arrive (``weightstream.sources.oci.digest``:
a reader whose piece is next hashes it in place, one ahead waits for its turn, then copies its piece aside). A
blob is checked against its digest when its last byte is hashed; small gaps the load never reads (tar headers)
are read when its file closes. A mismatch is :class:`IntegrityError` naming the blob and the file. A load
that reads only part of a blob (a filter, a distributed rank) cannot check it: the store logs it when it closes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import urllib.parse
from collections.abc import Mapping
from typing import Any

from weightstream.errors import (
    AccessDeniedError,
    FormatError,
    IntegrityError,
    NotFound,
    SourceChangedError,
    SourceError,
    logger,
)
from weightstream.formats import oci
from weightstream.sources.http.transport import RangeTarget
from weightstream.sources.objects.versioned import RemoteStore, known_options
from weightstream.sources.oci.auth import Exchange, RegistryAuth
from weightstream.sources.oci.digest import WHOLE_CHECK_CHUNK_BYTES, BlobHash, held_blob_digest
from weightstream.sources.retry import RetryPolicy

log = logger(__name__)

STORAGE_OPTIONS = ("username", "password", "anonymous", "insecure")
"""What ``storage_options`` may hold for ``oci://``: credentials (or ``anonymous=True``: none, and no Docker login
either), and ``insecure`` (plain HTTP)."""
MAX_REDIRECTS = 5
REDIRECTS = frozenset({301, 302, 303, 307, 308})
GAP_FILL_BYTES = 4 << 20
"""Unread bytes of a blob (tar headers, padding) read when its file closes, so that it can be checked."""


@dataclasses.dataclass
class Artifact:
    """A resolved artifact: the manifest digest every read is pinned to, and its files by path."""

    digest: str
    files: dict[str, oci.ArtifactFile]
    directories: set[str]


class OciStore(RemoteStore):
    """Lists and opens the files of artifacts in OCI registries (see the module's description).

    Example:
        >>> store = OciStore()  # doctest: +SKIP
        >>> store.list_names("oci://127.0.0.1:5000/models/llama:v1")  # doctest: +SKIP
        ['config.json', 'model.safetensors']
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None) -> None:
        options = known_options("oci", storage_options, STORAGE_OPTIONS)
        super().__init__(policy)
        self._options = options
        self._artifacts: dict[str, Artifact] = {}
        self._auth: dict[tuple[str, str], RegistryAuth] = {}
        self._locations: dict[str, str] = {}
        """Blob URL -> where its redirect led (asked for again when that answers 401 or 403)."""
        self._hashes: dict[str, BlobHash] = {}
        self._lock = threading.Lock()

    def is_dir(self, uri: str) -> bool:
        reference = oci.parse_reference(uri)
        return reference.path in self._artifact(reference).directories

    def exists(self, uri: str) -> bool:
        reference = oci.parse_reference(uri)
        artifact = self._artifact(reference)
        return reference.path in artifact.directories or reference.path in artifact.files

    def list_names(self, uri: str) -> list[str]:
        reference = oci.parse_reference(uri)
        artifact = self._artifact(reference)
        if reference.path not in artifact.directories:
            raise NotFound(f"{uri}: no such directory in the artifact")
        prefix = f"{reference.path}/" if reference.path else ""
        names = {path[len(prefix) :].split("/", 1)[0] for path in (*artifact.files, *artifact.directories)}
        return sorted(name for name in names if name and (prefix + name) != reference.path)

    def open(self, uri: str, *, direct: bool | str = False) -> OciSource:
        reference = oci.parse_reference(uri)
        artifact = self._artifact(reference)
        file = artifact.files.get(reference.path)
        if file is None:
            what = "a directory" if reference.path in artifact.directories else "not in the artifact"
            raise NotFound(f"{uri}: {what} ({reference.artifact} is {artifact.digest})")
        return OciSource(self, uri, reference, file)

    def open_pinned(self, uri: str, size: int, version: str, *, direct: bool | str = False) -> OciSource:
        source = self.open(uri)
        if (source.size, source.version) != (size, version):
            raise SourceChangedError(
                f"{uri}: is {source.version} ({source.size} bytes) now, {version} ({size} bytes) when it was planned"
            )
        return source

    def close(self) -> None:
        """Close the connections; say which blobs this store could not check (partial reads)."""
        super().close()
        with self._lock:
            unchecked = [state for state in self._hashes.values() if not state.checked]
            self._hashes.clear()
        for state in unchecked:
            log.warning(
                "%s: blob %s NOT checked against its digest: %d of its %d bytes were read (a partial load, or other "
                "files share its tar layer; a load through the node cache checks whole blobs)",
                state.what,
                state.digest,
                state.hashed_bytes,
                state.size,
            )

    def range_target(self, source: OciSource) -> RangeTarget:
        """Where the source's blob is (after redirects), with the credentials its host may see."""
        url = self._blob_url(source.reference, source.file.digest)
        location = self._locations.get(url) or self._resolve_blob(source.reference, url)
        headers = self._auth_for(source.reference).headers() if _same_host(url, location) else {}
        return RangeTarget(location, headers)

    def refresh(self, source: OciSource, denied: AccessDeniedError) -> None:
        """After a 401 or 403 mid-load: a new token (the registry's challenge) or a new redirect (an expired one)."""
        url = self._blob_url(source.reference, source.file.digest)
        location = self._locations.pop(url, url)
        if _same_host(url, location):
            self._auth_for(source.reference).answer(denied.challenge, self.fetch, str(denied))

    def rehash(self, file: oci.ArtifactFile, what: str) -> BlobHash:
        """A fresh running hash of ``file``'s blob in place of one that could not check it in line."""
        with self._lock:
            state = self._hashes[file.digest] = BlobHash(file.digest, file.blob_size, what)
            return state

    def hash_of(self, file: oci.ArtifactFile, what: str) -> BlobHash:
        """The running hash of ``file``'s blob (shared by every file and read of it in this store)."""
        with self._lock:
            state = self._hashes.get(file.digest)
            if state is None:
                state = self._hashes[file.digest] = BlobHash(file.digest, file.blob_size, what)
            return state

    def _artifact(self, reference: oci.Reference) -> Artifact:
        with self._lock:
            known = self._artifacts.get(reference.artifact)
        if known is not None:
            return known
        artifact = self._resolve(reference)
        with self._lock:
            return self._artifacts.setdefault(reference.artifact, artifact)

    def _resolve(self, reference: oci.Reference) -> Artifact:
        """The manifest the reference names (once, pinned by digest), and the files of its layers."""
        digest, layers = self._manifest(reference, reference.selector, depth=0)
        files: dict[str, oci.ArtifactFile] = {}
        for layer in layers:
            oci.check_readable(layer, reference.artifact)
            found = self._tar_files(reference, layer) if layer.is_tar else [oci.raw_file(layer, reference.artifact)]
            for file in found:
                if file.path in files:
                    raise FormatError(f"{reference.artifact}: two layers hold {file.path}")
                files[file.path] = file
        directories = {""}
        for path in files:
            parts = path.split("/")[:-1]
            directories.update("/".join(parts[: end + 1]) for end in range(len(parts)))
        clash = directories & set(files)
        if clash:
            raise FormatError(f"{reference.artifact}: {min(clash)} is both a file and a directory")
        log.info("%s is %s: %d files", reference.artifact, digest, len(files))
        return Artifact(digest, files, directories)

    def _manifest(self, reference: oci.Reference, selector: str, depth: int) -> tuple[str, list[oci.Layer]]:
        what = f"{reference.artifact} (manifest {selector})"
        url = f"{self.repository_url(reference)}/manifests/{selector}"
        answer, body = self._get(reference, url, {"Accept": ", ".join(oci.MANIFEST_TYPES)}, oci.MAX_MANIFEST_BYTES)
        if answer.status == 404:
            raise NotFound(f"{what}: no such manifest in {reference.registry}")
        if answer.status != 200:
            raise SourceError(f"{what}: HTTP {answer.status}: {body[:300].decode('utf-8', 'replace')}")
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if selector.startswith("sha256:") and digest != selector:
            raise IntegrityError(f"{what}: the manifest's bytes hash to {digest}")
        kind, content = oci.parse_manifest(body, what)
        if kind == "index":
            if depth:
                raise FormatError(f"{what}: an index lists another index")
            return self._manifest(reference, content[0], depth + 1)  # type: ignore[arg-type]
        return digest, content  # type: ignore[return-value]

    def _tar_files(self, reference: oci.Reference, layer: oci.Layer) -> list[oci.ArtifactFile]:
        """The regular files of an uncompressed tar layer, found by reading each member header."""
        what = f"{reference.artifact} layer {layer.digest}"
        source = OciSource(self, reference.artifact, reference, oci.ArtifactFile("", layer.digest, layer.size, 0, 0))
        files, at, pending = [], 0, {}
        while at + oci.TAR_BLOCK <= layer.size:
            member = oci.parse_tar_header(source.blob_bytes(at, oci.TAR_BLOCK), what)
            if member is None:
                break
            data = at + member.data_offset
            extended_header = member.kind in ("pax", "longname")
            # A PAX record's size is the member's (Python's tarfile and Go write one for members of 8 GiB and more).
            size = member.size if extended_header else oci.pax_size(pending, member.size, what)
            if size > layer.size - data:
                raise FormatError(f"{what}: member {member.name!r} at byte {at} runs past the layer's end")
            if extended_header:
                if size > oci.MAX_PAX_BYTES:
                    raise FormatError(f"{what}: an extended header of {size} bytes at byte {at}")
                extended = source.blob_bytes(data, size)
                pending = oci.parse_pax(extended, what) if member.kind == "pax" else {"path": _c_string(extended)}
            elif member.kind == "file":
                name = pending.get("path", member.name)
                files.append(oci.ArtifactFile(oci.member_path(name, what), layer.digest, layer.size, data, size))
                pending = {}
            else:
                pending = {}
            at = data + -(-size // oci.TAR_BLOCK) * oci.TAR_BLOCK
        return files

    def _resolve_blob(self, reference: oci.Reference, url: str) -> str:
        """Where the registry sends reads of the blob at ``url`` (itself, or its redirect's target)."""
        location = url
        for _ in range(MAX_REDIRECTS + 1):
            headers = {"Range": "bytes=0-0"}
            answer, _ = self._get(reference, location, headers, 1 << 16, credentials=_same_host(url, location))
            if answer.status in REDIRECTS and answer.getheader("Location"):
                location = urllib.parse.urljoin(location, answer.getheader("Location"))
                continue
            if answer.status == 404:
                raise NotFound(f"{reference.artifact}: blob {url.rsplit('/', 1)[-1]} is gone from the registry")
            self._locations[url] = location
            return location
        raise SourceError(f"{reference.artifact}: more than {MAX_REDIRECTS} redirects for {url}")

    def fetch(self, url: str, headers: Mapping[str, str], limit: int) -> Exchange:
        """A GET of a small document (at most ``limit`` bytes), retried as the store's policy says."""
        return self.policy.run(url, lambda: self.ranges.fetch(url, headers, limit))

    def _get(
        self, reference: oci.Reference, url: str, headers: Mapping[str, str], limit: int, *, credentials: bool = True
    ) -> Exchange:
        """A GET of a small document, answering the registry's 401 challenge once (a token, or basic auth)."""
        return self._auth_for(reference).send(
            lambda sent: self.fetch(url, {**headers, **sent}, limit), self.fetch, url, credentials=credentials
        )

    def _auth_for(self, reference: oci.Reference) -> RegistryAuth:
        key = (reference.registry, reference.repository)
        with self._lock:
            auth = self._auth.get(key)
            if auth is None:
                auth = self._auth[key] = RegistryAuth.of(reference, self._options)
            return auth

    def repository_url(self, reference: oci.Reference) -> str:
        """``http(s)://registry/v2/repository``: plain HTTP for a loopback registry or ``insecure=True``."""
        host = reference.registry.split(":")[0].strip("[]")
        local = host in ("localhost", "127.0.0.1", "::1")
        scheme = "http" if self._options.get("insecure", local) else "https"
        return f"{scheme}://{reference.registry}/v2/{reference.repository}"

    def _blob_url(self, reference: oci.Reference, digest: str) -> str:
        return f"{self.repository_url(reference)}/blobs/{digest}"


class OciSource:
    """A file of an artifact: ``file.size`` bytes at ``file.offset`` in its blob, read by range, hashed as read."""

    direct = False

    def __init__(self, store: OciStore, uri: str, reference: oci.Reference, file: oci.ArtifactFile) -> None:
        self.store = store
        self.uri = uri
        self.reference = reference
        self.file = file
        self.size = file.size
        self.version = (
            file.digest if file.offset == 0 and file.size == file.blob_size else f"{file.digest}@{file.offset}"
        )

    def read(self, offset: int, nbytes: int) -> bytes:
        buffer = bytearray(nbytes)
        self.read_into(offset, memoryview(buffer))
        return bytes(buffer)

    def read_into(self, offset: int, buffer: memoryview) -> None:
        if offset < 0 or offset + len(buffer) > self.size:
            raise SourceError(f"{self.uri}: range {offset}..{offset + len(buffer)} is past its end ({self.size} bytes)")
        self.blob_into(self.file.offset + offset, buffer)

    def blob_bytes(self, at: int, nbytes: int) -> bytes:
        """``nbytes`` of the blob from ``at`` (tar headers)."""
        buffer = bytearray(nbytes)
        self.blob_into(at, memoryview(buffer))
        return bytes(buffer)

    def blob_into(self, at: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from byte ``at`` of the blob; retried and resumed as the store's policy says, once more
        after a 401 or 403 (a new token, or a new redirect), then hashed."""
        if not len(buffer):
            return
        self._fetch_blob(at, buffer)
        self.store.hash_of(self.file, self.uri).feed(at, buffer)

    def _fetch_blob(self, at: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from byte ``at`` of the blob (not hashed)."""
        span = f"{self.uri}: range {at - self.file.offset}..{at - self.file.offset + len(buffer)}"
        received = [0]

        def attempt() -> None:
            target = self.store.range_target(self)
            self.store.ranges.get_into(target, self.file.blob_size, at, buffer, received, span)

        try:
            self.store.policy.run(span, attempt)
        except AccessDeniedError as denied:
            self.store.refresh(self, denied)
            self.store.policy.run(span, attempt)

    def verify_unchanged(self) -> None:
        """Check the blob against its digest once all of it is hashed, reading small gaps the load skipped.

        Raises:
            IntegrityError: the blob does not hash to its digest (now, or when an earlier read found it).
        """
        state = self.store.hash_of(self.file, self.uri)
        state.raise_if_failed()
        for at, nbytes in state.gaps(GAP_FILL_BYTES):
            self.blob_into(at, memoryview(bytearray(nbytes)))

    def verify_whole(self, held: memoryview | None = None) -> None:
        """Check the whole blob that holds this file against its digest, reading whatever of it was not read (the
        other files of a tar layer, its headers), however much that is: what the node cache does before it
        publishes a file, so that it never serves bytes of a blob it has not checked.

        ``held``: this file's bytes as the caller holds them, some of them not read through this source (a node
        cache's segment filled by its fleet's peers). Unless the blob was checked whole already, it is hashed
        again from ``held`` (and from the origin for the rest of a tar layer); a mismatch then says so without
        marking the blob corrupt in the registry (those bytes did not come from it).

        Raises:
            IntegrityError: the blob does not hash to its digest.
        """
        if held is not None and not self.store.hash_of(self.file, self.uri).checked:
            self._check_held(held)
            return
        state = self.store.hash_of(self.file, self.uri)
        state.raise_if_failed()
        if state.abandoned:  # pieces came too far out of order to hash in line: hash it again, in order
            state = self.store.rehash(self.file, self.uri)
        for at, nbytes in state.gaps(None):
            for offset in range(at, at + nbytes, WHOLE_CHECK_CHUNK_BYTES):
                self.blob_into(offset, memoryview(bytearray(min(WHOLE_CHECK_CHUNK_BYTES, at + nbytes - offset))))
        state.raise_if_failed()
        if not state.checked:
            raise IntegrityError(f"{self.uri}: blob {self.file.digest} could not be checked against its digest")

    def _check_held(self, held: memoryview) -> None:
        """Hash the blob in order from ``held`` (this file's bytes) and the origin (the rest of its blob)."""
        if len(held) != self.size:
            raise ValueError(f"{self.uri}: {len(held)} bytes held, not its {self.size}")
        actual = held_blob_digest(held, self.file.offset, self.file.blob_size, self._fetch_blob)
        if actual != self.file.digest:
            raise IntegrityError(
                f"{self.uri}: blob {self.file.digest}: the bytes held for it hash to {actual} (some came from peers "
                "of the node cache's fleet: not the registry's)"
            )

    def close(self) -> None:
        """Nothing to release: connections belong to the store."""


def _c_string(data: bytes) -> str:
    return data.split(b"\0", 1)[0].decode("utf-8", "replace")


def _same_host(url: str, location: str) -> bool:
    return urllib.parse.urlsplit(url).netloc == urllib.parse.urlsplit(location).netloc
