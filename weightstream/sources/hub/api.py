"""The Hub's side: where it is and how to ask it (``HubSettings``, from options and the environment), and what its
answer for a revision means (the commit it names and the repository's files).

Settings come from ``storage_options`` or, as ``huggingface_hub`` reads them, the environment: ``HF_HUB_CACHE`` (or
``HF_HOME``), ``HF_ENDPOINT``, ``HF_TOKEN`` (or the token file ``huggingface-cli login`` writes) and
``HF_HUB_OFFLINE``.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import urllib.parse
from collections.abc import Mapping
from typing import Any

from weightstream.errors import InvalidOptionError, NotFound, OptionError, SourceError
from weightstream.sources.hub.ids import COMMIT, HUB_SCHEME, HubReference, leaves_its_folder
from weightstream.sources.local.regular import read_regular

DEFAULT_ENDPOINT = "https://huggingface.co"
TRUE_VALUES = frozenset({"1", "ON", "YES", "TRUE"})
"""What ``huggingface_hub`` takes for true in ``HF_HUB_OFFLINE``."""
MAX_REVISION_ANSWER_BYTES = 32 << 20
"""The Hub's answer for one revision lists every file of the repository; a large repository's is a few MB."""
OPTION_NAMES = ("cache_dir", "endpoint", "headers", "offline", "token")


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


def revision_url(settings: HubSettings, reference: HubReference) -> str:
    """The Hub API's URL that names the commit of ``reference``'s revision and lists its files.

    Example:
        >>> revision_url(HubSettings("/cache"), HubReference("org/llama", "refs/pr/1"))
        'https://huggingface.co/api/models/org/llama/revision/refs%2Fpr%2F1'
    """
    repo_id = urllib.parse.quote(reference.repo_id)
    return f"{settings.endpoint}/api/models/{repo_id}/revision/{urllib.parse.quote(reference.revision, safe='')}"


def revision_answer(
    status: int, code: str, body: bytes, where: str, settings: HubSettings, reference: HubReference
) -> tuple[str, list[str]]:
    """The commit and file names of the Hub's answer for a revision (``status``, its ``X-Error-Code``, the body).

    Raises:
        NotFound: no such repository or revision, or it is private or gated and the token does not grant it.
        SourceError: a refusal (403), another failure, or an answer that is not what the Hub sends.

    Example:
        >>> body = b'{"sha": "' + b"a" * 40 + b'", "siblings": [{"rfilename": "model.safetensors"}]}'
        >>> revision_answer(200, "", body, "hf://org/llama", HubSettings("/cache"), HubReference("org/llama"))
        ('aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa', ['model.safetensors'])
    """
    if status == 404 and code == "RevisionNotFound":
        raise NotFound(f"{where}: the repository has no revision {reference.revision!r}")
    if status in (401, 404):
        advice = (
            "the token was refused or does not grant it"
            if settings.token
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
    unsafe = [name for name in files if leaves_its_folder(name)]
    if unsafe:
        raise SourceError(f"{where}: the Hub's answer names files outside the repository ({unsafe[0]!r})")
    return document["sha"], files


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
