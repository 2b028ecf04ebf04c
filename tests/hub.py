"""Hugging Face test fixtures made offline: a cache laid out as ``huggingface_hub`` writes it (refs,
snapshots of relative links, blobs), and a small real Hub on 127.0.0.1 (the revision API, ``resolve/``
answering 302 to a CDN on another loopback host, tokens checked) over a real range server."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import urllib.parse
from pathlib import Path

from typing_extensions import Self

from tests.rangeserver import LoopbackServer, QuietHandler, RangeServer


def commit_of(text: str) -> str:
    """A 40-digit commit hash made from ``text``."""
    return hashlib.sha1(text.encode()).hexdigest()


def cache_model(
    cache_dir: Path,
    repo_id: str,
    model: Path,
    *,
    revision: str = "main",
    commit: str | None = None,
    skip: tuple[str, ...] = (),
) -> str:
    """Put ``model``'s files (a directory, recursively) into the cache as commit ``commit`` of ``repo_id``, with
    ``refs/<revision>`` naming it; ``skip`` leaves those files out (an interrupted download). The commit."""
    commit = commit or commit_of(f"{repo_id}@{revision}:{model}")
    repository = cache_dir / ("models--" + repo_id.replace("/", "--"))
    for file in sorted(path for path in model.rglob("*") if path.is_file()):
        relative = file.relative_to(model).as_posix()
        if relative in skip:
            continue
        data = file.read_bytes()
        blob = (
            repository
            / "blobs"
            / (
                hashlib.sha256(data).hexdigest()
                if file.suffix == ".safetensors"
                else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            )
        )
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repository / "snapshots" / commit / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    reference = repository / "refs" / revision
    reference.parent.mkdir(parents=True, exist_ok=True)
    reference.write_text(commit)
    return commit


class HubServer(LoopbackServer):
    """``with HubServer(root) as hub``: ``hub.publish(repo_id, model_dir, revision)`` makes a commit;
    ``hub.endpoint`` is the Hub's URL (``HF_ENDPOINT``), ``hub.cdn`` the range server it redirects to.
    ``token`` set: every Hub request without ``Bearer <token>`` is answered 401 (a private repository).
    ``hub.authorizations`` holds the ``Authorization`` of each Hub request, ``hub.cdn.authorizations`` the CDN's."""

    def __init__(self, root: Path, token: str | None = None, gated: bool = False) -> None:
        self.root = root
        self.token = token
        self.gated = gated
        self.revisions: dict[str, dict[str, str]] = {}
        """repo id -> revision -> commit."""
        self.commits: dict[str, set[str]] = {}
        """repo id -> every commit published (a moved branch leaves its old commit readable, as on the Hub)."""
        self._published = 0
        self.requests: list[str] = []
        self.authorizations: list[str | None] = []
        self.cdn = RangeServer(root, host="127.0.0.2")
        outer = self

        class Handler(QuietHandler):
            def do_HEAD(self) -> None:
                self._answer()

            def do_GET(self) -> None:
                self._answer()

            def _answer(self) -> None:
                outer.requests.append(f"{self.command} {self.path}")
                outer.authorizations.append(self.headers.get("Authorization"))
                if outer.token is not None and self.headers.get("Authorization") != f"Bearer {outer.token}":
                    return self._send(401, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
                if outer.gated:
                    return self._send(403, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"})
                path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
                if path.startswith("/api/models/"):
                    repo_id, _, revision = path[len("/api/models/") :].partition("/revision/")
                    return self._revision(repo_id, revision)
                repo_id, _, rest = path.lstrip("/").partition("/resolve/")
                commit, _, name = rest.partition("/")
                if (
                    commit not in outer.commits.get(repo_id, set())
                    or not (outer.root / repo_id / commit / name).is_file()
                ):
                    return self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
                location = f"{outer.cdn.url}/{urllib.parse.quote(f'{repo_id}/{commit}/{name}')}"
                self._send(302, b"", {"Location": location, "X-Repo-Commit": commit})

            def _revision(self, repo_id: str, revision: str) -> None:
                commits = outer.revisions.get(repo_id)
                if commits is None:
                    return self._send(401, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
                commit = revision if revision in outer.commits[repo_id] else commits.get(revision)
                if commit is None:
                    return self._send(404, b'{"error": "Revision not found"}', {"X-Error-Code": "RevisionNotFound"})
                tree = outer.root / repo_id / commit
                siblings = [
                    {"rfilename": path.relative_to(tree).as_posix()}
                    for path in sorted(tree.rglob("*"))
                    if path.is_file()
                ]
                self._send(
                    200,
                    json.dumps({"id": repo_id, "sha": commit, "siblings": siblings}).encode(),
                    {"Content-Type": "application/json"},
                )

            def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)

        super().__init__(Handler, "127.0.0.1", "test-hub")
        self.endpoint = self.url

    def publish(self, repo_id: str, model: Path, revision: str = "main") -> str:
        """``model``'s files as a new commit of ``repo_id``, which ``revision`` then names. The commit."""
        self._published += 1
        commit = commit_of(f"{repo_id}@{revision}:{model}:{self._published}")
        shutil.copytree(model, self.root / repo_id / commit)
        self.revisions.setdefault(repo_id, {})[revision] = commit
        self.commits.setdefault(repo_id, set()).add(commit)
        return commit

    def __enter__(self) -> Self:
        self.cdn.__enter__()
        return super().__enter__()

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        self.cdn.__exit__(*exc_info)
