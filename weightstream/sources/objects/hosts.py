"""An object store's endpoint, checked to have a name that resolves before the first request: the SDKs under the
stores retry an unknown host as a broken connection (gcsfs for minutes), so a mistyped endpoint or a machine without
a network would be silence and then "stalled"; here it is an error at once."""

from __future__ import annotations

import socket
import time
import urllib.parse

from weightstream.errors import SourceError

LOOKUP_RETRY_S = (0.25, 0.75, 2.0)
"""Pauses between the lookups of a name the resolver says it cannot answer for now (``EAI_AGAIN``)."""


def check_endpoint(scheme: str, endpoint: str) -> None:
    """Refuse ``endpoint`` (a URL) when its host name does not resolve.

    Raises:
        SourceError: no such host, or the resolver failed for about 3 s.

    Example:
        >>> check_endpoint("s3", "http://127.0.0.1:8333")
        >>> check_endpoint("gs", "https://storage.example.invalid")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        weightstream.errors.SourceError: gs:// on https://storage.example.invalid: storage.example.invalid: no such ...
    """
    parts = urllib.parse.urlsplit(endpoint)
    host = parts.hostname
    if not host:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    for pause in (*LOOKUP_RETRY_S, None):
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            return
        except socket.gaierror as error:
            if error.errno != socket.EAI_AGAIN:
                raise SourceError(f"{scheme}:// on {endpoint}: {host}: no such host ({error.strerror})") from None
            if pause is None:
                raise SourceError(
                    f"{scheme}:// on {endpoint}: the name {host} did not resolve in {sum(LOOKUP_RETRY_S):.0f} s "
                    f"({error.strerror}): is there a network?"
                ) from None
            time.sleep(pause)
