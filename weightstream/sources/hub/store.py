"""Hugging Face model ids as a store: ``hf://org/name[@revision][/path]`` read from the local Hugging Face cache when
every file the checkpoint needs is there, and otherwise from the Hub itself through the HTTP source, pinned to the
commit the revision names when the load starts (so a push during the load cannot mix two commits). With
``HF_HUB_OFFLINE`` (or ``offline=True``) a miss is an error, never a request. The token goes to the Hub only: a
redirect to its CDN carries none.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Mapping
from typing import Any

from weightstream.errors import NotFound, SourceError, logger
from weightstream.sources.base import Store
from weightstream.sources.http.store import HttpStore, RedirectTrail
from weightstream.sources.hub.api import MAX_REVISION_ANSWER_BYTES, HubSettings, revision_answer, revision_url
from weightstream.sources.hub.hf_cache import cached_location
from weightstream.sources.hub.ids import HubReference, parse_hub_uri
from weightstream.sources.local.file import LocalStore
from weightstream.sources.retry import RetryPolicy, Transient

log = logger(__name__)


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
        commit, files = self._revision(reference, revision_url(self.settings, reference))
        self.commit = commit
        self.root = f"{self.settings.endpoint}/{urllib.parse.quote(reference.repo_id)}/resolve/{commit}"
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
        return revision_answer(status, code, body, f"{reference.uri} ({api})", self.settings, reference)
