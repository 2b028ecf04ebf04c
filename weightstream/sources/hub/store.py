"""Hugging Face model ids: ``hf://org/name[@revision][/path]``, and the bare ids engines are given.

An id is read from the local Hugging Face cache when every file the checkpoint needs is there
(``models--org--name/refs/<revision>`` names a commit, ``snapshots/<commit>/`` links each file to
``blobs/``: the layout ``huggingface_hub`` writes), and otherwise from the Hub itself through the
HTTP source, pinned to the commit the revision names when the load starts (so a push during the
load cannot mix two commits). Settings come from ``storage_options`` or, as ``huggingface_hub``
reads them, the environment: ``HF_HUB_CACHE`` (or ``HF_HOME``), ``HF_ENDPOINT``, ``HF_TOKEN`` (or
the token file ``huggingface-cli login`` writes) and ``HF_HUB_OFFLINE`` (a miss is then an error,
never a request). The token goes to the Hub only: a redirect to its CDN carries none.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from weightstream.errors import (
    InvalidOptionError,
    NotFound,
    OptionError,
    ShardIndexError,
    SourceError,
    UnsupportedInputError,
    logger,
)
from weightstream.formats.index import INDEX_NAME, MAX_INDEX_BYTES, parse_index
from weightstream.sources.base import Store
from weightstream.sources.http.store import HttpStore, RedirectTrail
from weightstream.sources.local.file import LocalStore
from weightstream.sources.local.regular import read_regular
from weightstream.sources.retry import RetryPolicy, Transient

log = logger(__name__)

HUB_SCHEME = "hf://"
DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
COMMIT = re.compile(r"[0-9a-f]{40}")
REPO_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
"""One part of a repository id (``org`` or ``name``), as the Hub allows them: at most 96 characters."""
REVISION = re.compile(r"[A-Za-z0-9._/+-]{1,255}")
"""A branch, tag or commit (``refs/pr/1`` included); ``..`` and an empty part are refused besides."""
TRUE_VALUES = frozenset({"1", "ON", "YES", "TRUE"})
"""What ``huggingface_hub`` takes for true in ``HF_HUB_OFFLINE``."""
MAX_REVISION_ANSWER_BYTES = 32 << 20
"""The Hub's answer for one revision lists every file of the repository; a large repository's is a few MB."""
MAX_REF_BYTES = 256
OPTION_NAMES = ("cache_dir", "endpoint", "headers", "offline", "token")


@dataclasses.dataclass(frozen=True)
class HubReference:
    """A model repository at a revision, and a path inside it (``""``: the whole repository)."""

    repo_id: str
    revision: str = DEFAULT_REVISION
    path: str = ""

    @property
    def uri(self) -> str:
        """The ``hf://`` URI naming it.

        Example:
            >>> HubReference("org/llama", "refs/pr/1", "fp16").uri
            'hf://org/llama@refs%2Fpr%2F1/fp16'
        """
        revision = "" if self.revision == DEFAULT_REVISION else "@" + urllib.parse.quote(self.revision, safe="")
        return f"{HUB_SCHEME}{self.repo_id}{revision}" + (f"/{self.path}" if self.path else "")

    @property
    def cache_folder(self) -> str:
        """The repository's folder in the cache, as ``huggingface_hub`` names it.

        Example:
            >>> HubReference("org/llama").cache_folder
            'models--org--llama'
        """
        return "models--" + self.repo_id.replace("/", "--")


def parse_hub_uri(uri: str) -> HubReference:
    """Parse ``hf://[models/]org/name[@revision][/path]`` (``revision`` percent-encoded where it has a ``/``).

    Raises:
        UnsupportedInputError: not a model URI of that form (dataset and Space repositories included).

    Example:
        >>> parse_hub_uri("hf://meta-llama/Llama-3.1-8B@main/original")
        HubReference(repo_id='meta-llama/Llama-3.1-8B', revision='main', path='original')
    """
    if not uri.startswith(HUB_SCHEME):
        raise UnsupportedInputError(f"{uri}: not an {HUB_SCHEME} URI")
    rest = uri[len(HUB_SCHEME) :]
    if "?" in rest or "#" in rest:
        raise UnsupportedInputError(
            f"{uri}: an {HUB_SCHEME} URI has no query or fragment; name a revision with @revision"
        )
    parts = rest.rstrip("/").split("/")
    if parts[0] in ("datasets", "spaces"):
        raise UnsupportedInputError(f"{uri}: only model repositories hold checkpoints here, not {parts[0]}")
    if parts[0] == "models":
        parts = parts[1:]
    repo_parts, path_parts = (parts[:2], parts[2:]) if len(parts) > 1 else (parts, [])
    repo_id, at, revision = "/".join(repo_parts).partition("@")
    if at:
        revision = urllib.parse.unquote(revision)
    else:
        revision = DEFAULT_REVISION
    reference = HubReference(repo_id, revision, "/".join(path_parts))
    check_reference(reference, uri)
    return reference


def check_reference(reference: HubReference, uri: str) -> None:
    """Raise ``UnsupportedInputError`` unless the repository id, revision and path are all well formed."""
    if not looks_like_repo_id(reference.repo_id):
        raise UnsupportedInputError(
            f"{uri}: {reference.repo_id!r} is not a model id: expected org/name (letters, digits, '-', '_', '.'; at "
            "most 96 each; no '--' or '..')"
        )
    revision = reference.revision
    if not REVISION.fullmatch(revision) or _leaves_its_folder(revision):
        raise UnsupportedInputError(f"{uri}: {revision!r} is not a revision (a branch, tag or commit)")
    if reference.path and _leaves_its_folder(reference.path):
        raise UnsupportedInputError(f"{uri}: {reference.path!r} is not a path inside the repository")


def hub_uri(repo_id: str, revision: str | None = None) -> str:
    """The ``hf://`` URI of a model id (``org/name``) at ``revision`` (default ``main``).

    Example:
        >>> hub_uri("Qwen/Qwen3-0.6B", "v1.0")
        'hf://Qwen/Qwen3-0.6B@v1.0'
    """
    reference = HubReference(repo_id, revision or DEFAULT_REVISION)
    check_reference(reference, repo_id)
    return reference.uri


def looks_like_repo_id(name: str) -> bool:
    """Whether ``name`` could be a Hub model id (``org/name`` or a bare ``name``) rather than a path or URI.

    Example:
        >>> looks_like_repo_id("Qwen/Qwen3-0.6B"), looks_like_repo_id("/models/qwen"), looks_like_repo_id("s3://b/m")
        (True, False, False)
    """
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(
        REPO_PART.fullmatch(part) and "--" not in part and ".." not in part for part in parts
    )


@dataclasses.dataclass(frozen=True)
class HubSettings:
    """Where the cache and the Hub are, the token, and whether requests may be made."""

    cache_dir: str
    endpoint: str = DEFAULT_ENDPOINT
    offline: bool = False
    token: str | None = dataclasses.field(default=None, repr=False)
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False)
    offline_by: str = "offline=True"
    """What set ``offline``, for the message of a miss."""

    @classmethod
    def from_options(
        cls, storage_options: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
    ) -> HubSettings:
        """``storage_options`` (``cache_dir``, ``endpoint``, ``offline``, ``token``, ``headers``) over the environment.

        Raises:
            InvalidOptionError: an unknown key. OptionError: a value of the wrong type.

        Example:
            >>> HubSettings.from_options({"cache_dir": "/cache", "offline": True}, environ={})
            HubSettings(cache_dir='/cache', endpoint='https://huggingface.co', offline=True, offline_by='offline=True')
        """
        options = dict(storage_options or {})
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise InvalidOptionError(
                f"storage_options for {HUB_SCHEME} take {', '.join(OPTION_NAMES)}; got {', '.join(unknown)}"
            )
        for name in ("cache_dir", "endpoint", "token"):
            value = options.get(name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise OptionError(
                    f"storage_options[{name!r}] for {HUB_SCHEME} must be a string, got {type(value).__name__}"
                )
        if not isinstance(options.get("offline", False), bool):
            raise OptionError(
                f"storage_options['offline'] for {HUB_SCHEME} must be True or False, got "
                f"{type(options['offline']).__name__}"
            )
        headers = options.get("headers") or {}
        if not isinstance(headers, Mapping) or not all(
            isinstance(key, str) and isinstance(value, str) for key, value in headers.items()
        ):
            raise OptionError(f"storage_options['headers'] for {HUB_SCHEME} must be a mapping of strings to strings")
        home = environ.get("HF_HOME") or os.path.join(
            environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
        )
        cache_dir = (
            options.get("cache_dir")
            or environ.get("HF_HUB_CACHE")
            or environ.get("HUGGINGFACE_HUB_CACHE")
            or os.path.join(home, "hub")
        )
        if "offline" in options:
            offline, offline_by = options["offline"], "offline=True"
        else:
            offline, offline_by = (
                environ.get("HF_HUB_OFFLINE", "").strip().upper() in TRUE_VALUES,
                "HF_HUB_OFFLINE is set",
            )
        token = (
            options.get("token")
            or environ.get("HF_TOKEN")
            or _token_file(environ.get("HF_TOKEN_PATH") or os.path.join(home, "token"))
        )
        endpoint = str(options.get("endpoint") or environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        if not endpoint.startswith(("http://", "https://")):
            raise InvalidOptionError(f"the Hugging Face endpoint must be an http(s):// URL, got {endpoint!r}")
        return cls(os.fspath(cache_dir), endpoint, offline, str(token) if token else None, dict(headers), offline_by)

    def request_headers(self) -> dict[str, str]:
        """The headers of every request to the Hub: the caller's, and the token as a bearer credential."""
        return {**self.headers, **({"Authorization": f"Bearer {self.token}"} if self.token else {})}


def locate(
    uri: str, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None
) -> tuple[Store, str]:
    """The store and location that serve the ``hf://`` URI ``uri``: the cache's snapshot if it holds the
    whole checkpoint, else the Hub's files at the commit the revision names now.

    Raises:
        NotFound: not cached while offline; no such repository, revision or path on the Hub.
        SourceError: the Hub refused the request (a private or gated repository: set ``HF_TOKEN``).

    Example:
        >>> store, location = locate("hf://Qwen/Qwen3-0.6B")  # doctest: +SKIP
        >>> location  # doctest: +SKIP
        '/root/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/c1899de289a04d12100db370d81485cdf75e47ca'
    """
    reference = parse_hub_uri(uri)
    settings = HubSettings.from_options(storage_options)
    cached, missing = cached_location(reference, settings.cache_dir)
    if cached is not None:
        log.info("%s: reading the Hugging Face cache's %s", uri, cached)
        return LocalStore(), cached
    if settings.offline:
        raise NotFound(
            f"{uri}: not in the Hugging Face cache at {settings.cache_dir} ({missing}), and {settings.offline_by}, so "
            "the Hub is not asked: "
            f"download it first (huggingface-cli download {reference.repo_id} --revision {reference.revision}) or go "
            "online"
        )
    store = HubStore(settings, policy)
    try:
        location = store.resolve(reference)
    except BaseException:
        store.close()
        raise
    log.info("%s: not in the Hugging Face cache (%s); reading %s", uri, missing, location)
    return store, location


def pin(uri: str, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None) -> str:
    """Where the ``hf://`` URI ``uri`` is from now on: the cache's snapshot path, or ``uri`` at the commit its
    revision names on the Hub now (so that later loads, in this process or others, read that commit).

    Example:
        >>> pin("hf://Qwen/Qwen3-0.6B", {"offline": False})  # doctest: +SKIP
        'hf://Qwen/Qwen3-0.6B@c1899de289a04d12100db370d81485cdf75e47ca'
    """
    store, location = locate(uri, storage_options, policy)
    try:
        if isinstance(store, HubStore):
            return dataclasses.replace(parse_hub_uri(uri), revision=store.commit).uri
        return location
    finally:
        store.close()


def cached_location(reference: HubReference, cache_dir: str) -> tuple[str | None, str]:
    """The cache's path for ``reference`` if it holds the whole checkpoint there (a file, or a directory with
    every shard its index names, or with a ``.safetensors`` file and no index), else None and what is missing.

    Example:
        >>> cached_location(HubReference("org/absent"), "/nonexistent")
        (None, 'no /nonexistent/models--org--absent/refs/main')
    """
    repository = os.path.join(cache_dir, reference.cache_folder)
    commit = reference.revision
    if not COMMIT.fullmatch(commit):
        ref_file = os.path.join(repository, "refs", reference.revision)
        try:
            commit = read_regular(ref_file, MAX_REF_BYTES).decode("ascii", "replace").strip()
        except NotFound:
            return None, f"no {ref_file}"
        except SourceError as error:
            if error.errno not in (errno.ENOTDIR, errno.EISDIR):
                raise
            return None, f"no {ref_file}"
        if not COMMIT.fullmatch(commit):
            return None, f"{ref_file} holds {commit[:60]!r}, not a commit hash"
    target = (
        os.path.join(repository, "snapshots", commit, *reference.path.split("/"))
        if reference.path
        else os.path.join(repository, "snapshots", commit)
    )
    if os.path.isfile(target):
        return target, ""
    if not os.path.isdir(target):
        return None, f"no {target}"
    index = os.path.join(target, INDEX_NAME)
    if os.path.isfile(index):
        if os.path.getsize(index) > MAX_INDEX_BYTES:
            raise ShardIndexError(
                f"{index}: {os.path.getsize(index)} bytes, over the {MAX_INDEX_BYTES}-byte limit for an index"
            )
        shards = parse_index(read_regular(index, MAX_INDEX_BYTES), index).shards
        missing = [shard for shard in shards if not os.path.isfile(os.path.join(target, shard))]
        if missing:
            return (
                None,
                f"{target} lacks {len(missing)} of the {len(shards)} shards its index names ({', '.join(missing[:3])})",
            )
        return target, ""
    if any(name.endswith(".safetensors") and os.path.isfile(os.path.join(target, name)) for name in os.listdir(target)):
        return target, ""
    return None, f"{target} holds no .safetensors file"


class HubStore(HttpStore):
    """The Hub's files of one repository at one commit, over HTTP: listed from the Hub's answer for the
    revision (so a directory needs no index), each file read from ``<endpoint>/<repo>/resolve/<commit>/``
    and its redirect to the CDN (without the token).

    Example:
        >>> store = HubStore(HubSettings.from_options({"cache_dir": "/cache"}, environ={}))
        >>> store.resolve(HubReference("Qwen/Qwen3-0.6B"))  # doctest: +SKIP
        'https://huggingface.co/Qwen/Qwen3-0.6B/resolve/c1899de289a04d12100db370d81485cdf75e47ca'
        >>> store.close()
    """

    lists = True

    def __init__(self, settings: HubSettings, policy: RetryPolicy | None = None) -> None:
        super().__init__({"headers": settings.request_headers()}, policy)
        self.settings = settings
        self.root = ""
        """``<endpoint>/<repo>/resolve/<commit>``, once resolved."""
        self.commit = ""
        self._files: frozenset[str] = frozenset()
        self._directories: frozenset[str] = frozenset()

    def resolve(self, reference: HubReference) -> str:
        """Ask the Hub which commit ``reference``'s revision names and what files it has; the location of its path."""
        repo_id = urllib.parse.quote(reference.repo_id)
        api = (
            f"{self.settings.endpoint}/api/models/{repo_id}/revision/{urllib.parse.quote(reference.revision, safe='')}"
        )
        commit, files = self._revision(reference, api)
        self.commit = commit
        self.root = f"{self.settings.endpoint}/{repo_id}/resolve/{commit}"
        self._files = frozenset(files)
        self._directories = frozenset(
            "/".join(name.split("/")[:depth]) for name in files for depth in range(len(name.split("/")))
        )
        if reference.path and reference.path not in self._files and reference.path not in self._directories:
            raise NotFound(f"{reference.uri}: the repository has no {reference.path!r} at commit {commit}")
        return self.root + (f"/{urllib.parse.quote(reference.path)}" if reference.path else "")

    def is_dir(self, uri: str) -> bool:
        return self._relative(uri) in self._directories

    def exists(self, uri: str) -> bool:
        relative = self._relative(uri)
        return relative in self._files or relative in self._directories

    def list_names(self, uri: str) -> list[str]:
        prefix = self._relative(uri)
        prefix = prefix + "/" if prefix else ""
        return sorted({name[len(prefix) :].split("/")[0] for name in self._files if name.startswith(prefix)})

    def _relative(self, uri: str) -> str:
        """``uri``'s path inside the repository (``""``: its root); SourceError for a URL outside it."""
        root = urllib.parse.urlsplit(self.root).path
        path = urllib.parse.urlsplit(uri).path
        if (
            not self.root
            or not (path == root or path.startswith(root + "/"))
            or not uri.startswith(self.settings.endpoint)
        ):
            raise SourceError(f"{uri}: not a file of the repository at {self.root or '(unresolved)'}")
        return urllib.parse.unquote(path[len(root) :]).strip("/")

    def _revision(self, reference: HubReference, api: str) -> tuple[str, list[str]]:
        """The commit and file names of the Hub's answer for the revision (redirects followed, retried as ranges
        are)."""

        trail = RedirectTrail(api)

        def attempt() -> tuple[int, str, bytes]:
            answer, body = self.redirected(
                api, lambda location, headers: self.ranges.fetch(location, headers, MAX_REVISION_ANSWER_BYTES), trail
            )
            if answer.status in (408, 429) or answer.status >= 500:
                raise Transient(f"HTTP {answer.status}")
            return answer.status, answer.getheader("X-Error-Code") or "", body

        status, code, body = self.policy.run(api, attempt)
        where = f"{reference.uri} ({api})"
        if status == 404 and code == "RevisionNotFound":
            raise NotFound(f"{where}: the repository has no revision {reference.revision!r}")
        if status in (401, 404):
            advice = (
                "the token was refused or does not grant it"
                if self.settings.token
                else "set HF_TOKEN (or storage_options={'token': ...})"
            )
            raise NotFound(
                f"{where}: HTTP {status}{f' {code}' if code else ''}: no such model repository, or it is private or "
                f"gated ({advice})"
            )
        if status == 403:
            raise SourceError(
                f"{where}: HTTP 403{f' {code}' if code else ''}: access to this repository is not granted to this "
                "token (a gated model: accept its terms on the Hub)"
            )
        if status != 200:
            raise SourceError(f"{where}: HTTP {status}: {body[:300].decode('utf-8', 'replace')}")
        return _commit_and_files(body, where)


def _commit_and_files(body: bytes, where: str) -> tuple[str, list[str]]:
    try:
        document = json.loads(body)
    except ValueError as error:
        raise SourceError(f"{where}: the Hub's answer is not JSON: {error}") from error
    if (
        not isinstance(document, dict)
        or not isinstance(document.get("sha"), str)
        or not COMMIT.fullmatch(document["sha"])
    ):
        raise SourceError(f"{where}: the Hub's answer names no commit (a 40-digit hex 'sha')")
    siblings = document.get("siblings")
    if not isinstance(siblings, list) or not all(
        isinstance(entry, dict) and isinstance(entry.get("rfilename"), str) for entry in siblings
    ):
        raise SourceError(f"{where}: the Hub's answer has no list of files ('siblings' with 'rfilename')")
    files = [entry["rfilename"] for entry in siblings]
    unsafe = [name for name in files if _leaves_its_folder(name)]
    if unsafe:
        raise SourceError(f"{where}: the Hub's answer names files outside the repository ({unsafe[0]!r})")
    return document["sha"], files


def _leaves_its_folder(path: str) -> bool:
    """Whether a ``/``-separated relative path has an empty, ``.`` or ``..`` part (a leading ``/`` is an empty one)."""
    return any(part in ("", ".", "..") for part in path.split("/"))


def _token_file(path: str) -> str | None:
    """The token ``huggingface-cli login`` saved, if any."""
    try:
        return read_regular(path, 4096).decode("utf-8", "replace").strip() or None
    except NotFound:
        return None
    except SourceError as error:
        if error.errno in (errno.ENOTDIR, errno.EISDIR, errno.EACCES):
            return None
        raise
