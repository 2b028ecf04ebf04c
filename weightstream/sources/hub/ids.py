"""Hugging Face model ids: ``hf://org/name[@revision][/path]`` URIs and the bare ``org/name`` ids engines are given.

Pure: names in, a checked ``HubReference`` or ``UnsupportedInputError`` out.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse

from weightstream.errors import UnsupportedInputError

HUB_SCHEME = "hf://"
DEFAULT_REVISION = "main"
COMMIT = re.compile(r"[0-9a-f]{40}")
REPO_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
"""One part of a repository id (``org`` or ``name``), as the Hub allows them: at most 96 characters."""
REVISION = re.compile(r"[A-Za-z0-9._/+-]{1,255}")
"""A branch, tag or commit (``refs/pr/1`` included); ``..`` and an empty part are refused besides."""


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
    if not REVISION.fullmatch(revision) or leaves_its_folder(revision):
        raise UnsupportedInputError(f"{uri}: {revision!r} is not a revision (a branch, tag or commit)")
    if reference.path and leaves_its_folder(reference.path):
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


def leaves_its_folder(path: str) -> bool:
    """Whether a ``/``-separated relative path has an empty, ``.`` or ``..`` part (a leading ``/`` is an empty one).

    Example:
        >>> leaves_its_folder("fp16/model.safetensors"), leaves_its_folder("../x"), leaves_its_folder("/etc")
        (False, True, True)
    """
    return any(part in ("", ".", "..") for part in path.split("/"))
