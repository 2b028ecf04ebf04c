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
``~/.docker/config.json``, its ``auths``). A token that expires (a 401 mid-load) is asked for again and the
range retried.

Integrity: each blob's bytes are hashed (sha256) in blob order as they arrive; pieces that arrive ahead of
the hash are copied aside until it reaches them (at most :data:`REORDER_BYTES`). A blob is checked against its
digest when its last byte is hashed; small gaps the load never reads (tar headers) are read when its file
closes. A mismatch is :class:`IntegrityError` naming the blob and the file. A load that reads only part of a
blob (a filter) cannot check it: the store says so in the log when it closes.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import threading
import time
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
from weightstream.sources.http_range import RangeTarget
from weightstream.sources.remote import RemoteStore, known_options
from weightstream.sources.retry import RetryPolicy

log = logger(__name__)

STORAGE_OPTIONS = ("username", "password", "insecure")
"""What ``storage_options`` may hold for ``oci://``: credentials, and ``insecure`` (plain HTTP)."""
MAX_REDIRECTS = 5
REDIRECTS = frozenset({301, 302, 303, 307, 308})
REORDER_BYTES = 512 << 20
"""Pieces of one blob held aside, copied, until the hash reaches them; beyond this the blob is not checked in line."""
WAIT_FOR_TURN_S = 0.5
"""How long a reader whose piece is ahead of the hash waits for its turn before copying the piece aside."""
GAP_FILL_BYTES = 4 << 20
"""Unread bytes of a blob (tar headers, padding) read when its file closes, so that it can be checked."""
MAX_TOKEN_BYTES = 1 << 20


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
            log.info(
                "%s: blob %s not checked against its digest: %d of its %d bytes were read (a partial load)",
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
            self._auth_for(source.reference).answer(denied.challenge, self, str(denied))

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
            if member.size > layer.size - data:
                raise FormatError(f"{what}: member {member.name!r} at byte {at} runs past the layer's end")
            if member.kind in ("pax", "longname"):
                if member.size > oci.MAX_PAX_BYTES:
                    raise FormatError(f"{what}: an extended header of {member.size} bytes at byte {at}")
                extended = source.blob_bytes(data, member.size)
                pending = oci.parse_pax(extended, what) if member.kind == "pax" else {"path": _c_string(extended)}
            elif member.kind == "file":
                name = pending.get("path", member.name)
                size = int(pending.get("size", member.size))
                files.append(oci.ArtifactFile(oci.member_path(name, what), layer.digest, layer.size, data, size))
                pending = {}
            else:
                pending = {}
            at += member.next_offset
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

    def _get(
        self, reference: oci.Reference, url: str, headers: Mapping[str, str], limit: int, *, credentials: bool = True
    ) -> tuple[Any, bytes]:
        """A GET of a small document, answering the registry's 401 challenge once (a token, or basic auth)."""
        auth = self._auth_for(reference)
        for attempt in range(2):
            sent = {**headers, **(auth.headers() if credentials else {})}
            answer, body = self.policy.run(url, lambda sent=sent: self.ranges.fetch(url, sent, limit))
            if answer.status == 401 and credentials and attempt == 0:
                auth.answer(answer.getheader("WWW-Authenticate") or "", self, f"{url}: HTTP 401")
                continue
            if answer.status in (401, 403):
                raise AccessDeniedError(f"{reference.artifact}: access denied (HTTP {answer.status}) for {url}")
            return answer, body
        raise AssertionError("unreachable")

    def _auth_for(self, reference: oci.Reference) -> RegistryAuth:
        key = (reference.registry, reference.repository)
        with self._lock:
            auth = self._auth.get(key)
            if auth is None:
                username, password = self._options.get("username"), self._options.get("password")
                if username is None:
                    username, password = docker_credentials(reference.registry)
                auth = self._auth[key] = RegistryAuth(reference, username, password)
            return auth

    def repository_url(self, reference: oci.Reference) -> str:
        """``http(s)://registry/v2/repository``: plain HTTP for a loopback registry or ``insecure=True``."""
        host = reference.registry.split(":")[0].strip("[]")
        local = host in ("localhost", "127.0.0.1", "::1")
        scheme = "http" if self._options.get("insecure", local) else "https"
        return f"{scheme}://{reference.registry}/v2/{reference.repository}"

    def _blob_url(self, reference: oci.Reference, digest: str) -> str:
        return f"{self.repository_url(reference)}/blobs/{digest}"


class RegistryAuth:
    """The credentials of one repository and the ``Authorization`` they currently buy (none, basic or a token)."""

    def __init__(
        self, reference: oci.Reference, username: str | None, password: str | None, actions: str = "pull"
    ) -> None:
        self.reference = reference
        self.actions = actions
        """What a token is asked for: ``pull``, or ``pull,push`` for ``weightstream push``."""
        self.username, self.password = username, password
        self._header: str | None = None
        self._lock = threading.Lock()

    def headers(self) -> dict[str, str]:
        with self._lock:
            return {} if self._header is None else {"Authorization": self._header}

    def answer(self, challenge: str, store: OciStore, what: str) -> None:
        """Meet a 401's ``WWW-Authenticate`` challenge: basic credentials, or a token from the realm it names.

        Raises:
            AccessDeniedError: no credentials for a basic challenge, or the token service refused.
        """
        scheme, _, parameters = challenge.partition(" ")
        if scheme.lower() == "basic":
            if self.username is None:
                raise AccessDeniedError(f"{what}: the registry asks for credentials (storage_options or docker login)")
            with self._lock:
                self._header = "Basic " + _basic(self.username, self.password or "")
            return
        if scheme.lower() != "bearer":
            raise AccessDeniedError(f"{what}: an authentication challenge weightstream cannot answer: {challenge:.80}")
        fields = _challenge_fields(parameters)
        realm = fields.get("realm")
        if not realm:
            raise AccessDeniedError(f"{what}: a bearer challenge without a realm")
        query = {
            "service": fields.get("service", ""),
            "scope": f"repository:{self.reference.repository}:{self.actions}",
        }
        url = f"{realm}{'&' if '?' in realm else '?'}{urllib.parse.urlencode(query)}"
        sent = {} if self.username is None else {"Authorization": "Basic " + _basic(self.username, self.password or "")}
        answer, body = store.policy.run(url, lambda: store.ranges.fetch(url, sent, MAX_TOKEN_BYTES))
        if answer.status != 200:
            raise AccessDeniedError(f"{what}: the token service at {realm} answered HTTP {answer.status}")
        try:
            document = json.loads(body)
            token = document.get("token") or document.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise AccessDeniedError(f"{what}: the token service at {realm} gave no token")
        with self._lock:
            self._header = f"Bearer {token}"


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
        self.store.hash_of(self.file, self.uri).feed(at, buffer)

    def verify_unchanged(self) -> None:
        """Check the blob against its digest once all of it is hashed, reading small gaps the load skipped."""
        state = self.store.hash_of(self.file, self.uri)
        for at, nbytes in state.gaps(GAP_FILL_BYTES):
            self.blob_into(at, memoryview(bytearray(nbytes)))

    def close(self) -> None:
        """Nothing to release: connections belong to the store."""


class BlobHash:
    """The sha256 of one blob, fed pieces in any order and hashed in blob order.

    A reader whose piece is next hashes it in place, outside the lock; one whose piece is ahead waits (its
    bytes stay where they landed) for the pieces before it, for at most :data:`WAIT_FOR_TURN_S`, then copies its
    piece aside and goes on (a piece before it may never come: a gap the load does not read). Pieces set aside
    are hashed when the hash reaches them.
    """

    def __init__(self, digest: str, size: int, what: str) -> None:
        self.digest, self.size, self.what = digest, size, what
        self.hashed_bytes = 0
        """Bytes hashed, and being hashed: the next piece to hash starts here."""
        self.checked = False
        self._hash = hashlib.sha256()
        self._ahead: dict[int, bytes] = {}
        self._ahead_bytes = 0
        self._abandoned = False
        self._hashing = False
        self._turn = threading.Condition()

    def feed(self, at: int, piece: memoryview) -> None:
        """Bytes ``at..at+len(piece)`` of the blob, as read.

        Raises:
            IntegrityError: they complete the blob and it does not hash to its digest.
        """
        deadline = time.monotonic() + WAIT_FOR_TURN_S
        with self._turn:
            while not self._done() and (self._hashing or at > self.hashed_bytes):
                left = deadline - time.monotonic()
                if left <= 0 and at > self.hashed_bytes:  # a piece before it is late, or never comes: keep a copy
                    self._set_aside(at, piece)
                    return
                self._turn.wait(max(left, 0.001))
            if self._done() or at + len(piece) <= self.hashed_bytes:
                return
            start, self._hashing = self.hashed_bytes, True
            self.hashed_bytes = at + len(piece)
        try:
            self._hash.update(piece[start - at :])
            with self._turn:
                pieces = self._take_aside()
            for offset, data in pieces:
                self._hash.update(memoryview(data)[offset:])
        finally:
            with self._turn:
                self._hashing = False
                self._turn.notify_all()
                if self.hashed_bytes == self.size and not self.checked:
                    self._finish()

    def gaps(self, limit: int) -> list[tuple[int, int]]:
        """The unread ranges between what is hashed and what is held aside, if they total at most ``limit``."""
        with self._turn:
            if self._done():
                return []
            gaps, at = [], self.hashed_bytes
            for start in sorted(self._ahead):
                if start > at:
                    gaps.append((at, start - at))
                at = max(at, start + len(self._ahead[start]))
            if at < self.size:
                gaps.append((at, self.size - at))
            return gaps if sum(nbytes for _, nbytes in gaps) <= limit else []

    def _done(self) -> bool:
        return self.checked or self._abandoned

    def _set_aside(self, at: int, piece: memoryview) -> None:
        """Keep a copy of a piece ahead of the hash (under the lock)."""
        if self._ahead_bytes + len(piece) > REORDER_BYTES:
            self._abandoned = True  # too far ahead to keep: the blob is not checked in line
            self._ahead.clear()
            self._ahead_bytes = 0
            return
        if len(self._ahead.get(at, b"")) < len(piece):
            self._ahead_bytes += len(piece) - len(self._ahead.get(at, b""))
            self._ahead[at] = bytes(piece)

    def _take_aside(self) -> list[tuple[int, bytes]]:
        """The pieces set aside that the hash has reached, in order, with where each starts being new (under the
        lock; :attr:`hashed_bytes` moves past them)."""
        taken = []
        while True:
            reached = sorted(start for start in self._ahead if start <= self.hashed_bytes)
            if not reached:
                return taken
            for start in reached:
                data = self._ahead.pop(start)
                self._ahead_bytes -= len(data)
                if start + len(data) > self.hashed_bytes:
                    taken.append((self.hashed_bytes - start, data))
                    self.hashed_bytes = start + len(data)

    def _finish(self) -> None:
        actual = "sha256:" + self._hash.hexdigest()
        self.checked = True
        if actual != self.digest:
            raise IntegrityError(f"{self.what}: blob {self.digest} hashes to {actual} (corrupted in the registry)")


def docker_credentials(registry: str) -> tuple[str | None, str | None]:
    """The username and password ``docker login`` stored for ``registry`` (``auths`` of the Docker config file),
    or ``(None, None)``.

    Example:
        >>> docker_credentials("registry.invalid:1")
        (None, None)
    """
    path = os.path.join(os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker"), "config.json")
    try:
        with open(path) as config:
            auths = json.load(config).get("auths", {})
    except (OSError, ValueError, AttributeError):
        return None, None
    entry = auths.get(registry) or auths.get(f"https://{registry}") or auths.get(f"http://{registry}")
    if not isinstance(entry, dict):
        return None, None
    if isinstance(entry.get("auth"), str):
        try:
            username, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None, None
        return username, password
    return entry.get("username"), entry.get("password")


def _basic(username: str, password: str) -> str:
    return base64.b64encode(f"{username}:{password}".encode()).decode()


def _challenge_fields(parameters: str) -> dict[str, str]:
    """``realm="...",service="..."`` as a mapping.

    Example:
        >>> _challenge_fields('realm="https://auth.io/token",service="registry.io",scope="repository:a:pull"')
        {'realm': 'https://auth.io/token', 'service': 'registry.io', 'scope': 'repository:a:pull'}
    """
    fields = {}
    for part in _split_quoted(parameters):
        name, equals, value = part.strip().partition("=")
        if equals:
            fields[name.strip().lower()] = value.strip().strip('"')
    return fields


def _split_quoted(text: str) -> list[str]:
    parts, current, quoted = [], [], False
    for character in text:
        if character == '"':
            quoted = not quoted
        if character == "," and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(character)
    parts.append("".join(current))
    return parts


def _c_string(data: bytes) -> str:
    return data.split(b"\0", 1)[0].decode("utf-8", "replace")


def _same_host(url: str, location: str) -> bool:
    return urllib.parse.urlsplit(url).netloc == urllib.parse.urlsplit(location).netloc
