"""Credentials for an OCI registry: anonymous, basic, or the bearer-token flow a 401's ``WWW-Authenticate``
challenge starts (``Bearer realm=...,service=...``), from ``storage_options`` or the Docker config file."""

from __future__ import annotations

import base64
import errno
import json
import os
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from weightstream.errors import AccessDeniedError, FormatError, NotFound, SourceError
from weightstream.formats import oci
from weightstream.formats.strict_json import parse_json
from weightstream.sources.local.regular import read_regular

MAX_TOKEN_BYTES = 1 << 20
MAX_CONFIG_BYTES = 1 << 20
"""A Docker config file over this is refused."""
Exchange = tuple[Any, bytes]
"""An HTTP answer and its body."""
Fetch = Callable[[str, Mapping[str, str], int], Exchange]
"""A GET of a small document (URL, headers, most bytes), retried as the store's policy says."""


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

    @classmethod
    def of(cls, reference: oci.Reference, options: Mapping[str, Any], actions: str = "pull") -> RegistryAuth:
        """The credentials ``options`` give (``username``, ``password``), else (unless ``anonymous``) those
        ``docker login`` stored."""
        username, password = options.get("username"), options.get("password")
        if username is None and not options.get("anonymous"):
            username, password = docker_credentials(reference.registry)
        return cls(reference, username, password, actions)

    def headers(self) -> dict[str, str]:
        with self._lock:
            return {} if self._header is None else {"Authorization": self._header}

    def send(
        self,
        request: Callable[[dict[str, str]], Exchange],
        fetch: Fetch,
        url: str,
        *,
        credentials: bool = True,
        repeatable: bool = True,
    ) -> Exchange:
        """``request(headers)`` with this repository's ``Authorization`` (none if not ``credentials``); a 401 is
        answered once (:meth:`answer`) and the request sent again, if it is ``repeatable`` (a streamed body is not).

        Raises:
            AccessDeniedError: a 401 or 403 that stands.
        """
        answer, body = request(self.headers() if credentials else {})
        if answer.status == 401 and credentials and repeatable:
            self.answer(answer.getheader("WWW-Authenticate") or "", fetch, f"{url}: HTTP 401")
            answer, body = request(self.headers())
        if answer.status in (401, 403):
            raise AccessDeniedError(f"{self.reference.artifact}: access denied (HTTP {answer.status}) for {url}")
        return answer, body

    def answer(self, challenge: str, fetch: Fetch, what: str) -> None:
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
        answer, body = fetch(url, sent, MAX_TOKEN_BYTES)
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


def docker_credentials(registry: str) -> tuple[str | None, str | None]:
    """The username and password ``docker login`` stored for ``registry`` (``auths`` of the Docker config file),
    or ``(None, None)``.

    Example:
        >>> docker_credentials("registry.invalid:1")
        (None, None)
    """
    path = os.path.join(os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker"), "config.json")
    try:
        config = read_regular(path, MAX_CONFIG_BYTES)
    except NotFound:
        return None, None
    except SourceError as error:
        if error.errno in (errno.ENOTDIR, errno.EISDIR, errno.EACCES):
            return None, None
        raise
    try:
        auths = parse_json(config.decode("utf-8"), FormatError, path).get("auths", {})
    except (FormatError, UnicodeDecodeError, AttributeError):
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
