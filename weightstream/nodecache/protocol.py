"""The cache's wire format: length-prefixed JSON messages on a Unix stream socket, file descriptors
beside them (``SCM_RIGHTS``).

A message is 4 bytes of big-endian length, then that many bytes of one JSON object. Requests are at most
:data:`MAX_REQUEST_BYTES` (the daemon reads no more, whatever a client claims), answers at most
:data:`MAX_ANSWER_BYTES`; a message carries at most :data:`MAX_FDS` descriptors, which travel with its
first byte. Every message is parsed strictly (duplicate keys, NaN and lone surrogates refused) and
checked field by field against what its operation allows before anything acts on it.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import re
import socket
import struct
import time
from collections.abc import Mapping

from weightstream.errors import (
    CacheError,
    CacheProtocolError,
    CacheUnavailableError,
    FormatError,
    WeightstreamError,
    redact,
)
from weightstream.formats.strict_json import parse_json

LENGTH = struct.Struct(">I")
MAX_REQUEST_BYTES = 64 << 10
"""A request names one file and its storage options: 64 KiB is far more than any needs."""
KEY = re.compile(r"^[0-9a-f]{32}$")
"""An entry's (a segment's) key: the first 32 hex digits of a sha256."""
MAX_ANSWER_BYTES = 16 << 20
"""An answer lists at most the cache's entries (``ls``): 16 MiB holds about 50,000."""
MAX_FDS = 1
"""Descriptors per message: an ``attach`` answer hands over one segment, a ``device`` answer one device copy."""
HEAD_BYTES = 64 << 10
"""An attach answer carries the sha256 of the segment's first bytes: the client checks the segment it maps
against it (the header it then parses is checked by the parser itself). 64 KiB: 1 MiB cost 3 ms an attach."""

OPERATIONS: dict[str, dict[str, tuple[type, ...]]] = {
    "attach": {"uri": (str,), "size": (int, type(None)), "version": (str, type(None)), "storage_options": (dict,)},
    "device": {
        "uri": (str,),
        "size": (int, type(None)),
        "version": (str, type(None)),
        "storage_options": (dict,),
        "gpu": (str,),
    },
    "room": {"bytes": (int,), "uri": (str,)},
    "ls": {},
    "stats": {},
    "evict": {"key": (str, type(None)), "uri": (str,), "all": (bool,)},
    "stop": {},
}
"""Each operation and the fields its request may hold (with their types); ``op`` is always there."""


def encode(message: Mapping[str, object]) -> bytes:
    """One message as it goes on the socket.

    Example:
        >>> encode({"op": "ls"})
        b'\\x00\\x00\\x00\\x0c{"op": "ls"}'
    """
    body = json.dumps(message, allow_nan=False).encode()
    return LENGTH.pack(len(body)) + body


def send(sock: socket.socket, message: Mapping[str, object], fds: tuple[int, ...] = ()) -> None:
    """Send ``message`` (and ``fds`` with its first byte)."""
    data = encode(message)
    if len(fds) > MAX_FDS:
        raise CacheProtocolError(f"{len(fds)} descriptors in one message; at most {MAX_FDS}")
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def receive(
    sock: socket.socket, limit: int, what: str, deadline: float | None = None
) -> tuple[dict[str, object], list[int]]:
    """The next message on ``sock`` (at most ``limit`` bytes of JSON) and the descriptors that came with it, whole
    by ``deadline`` (``time.monotonic()``) if given, however its bytes trickle in; else within the socket's timeout
    of each other.

    Raises:
        CacheUnavailableError: the peer closed the connection before a whole message.
        TimeoutError: ``deadline`` passed first.
        CacheProtocolError: a message over ``limit``, not JSON, or not an object (its descriptors closed).
    """
    fds: list[int] = []
    try:
        header = _receive_exactly(sock, LENGTH.size, fds, what, deadline)
        (length,) = LENGTH.unpack(header)
        if length > limit:
            raise CacheProtocolError(f"{what}: a message of {length} bytes; at most {limit} are accepted")
        body = _receive_exactly(sock, length, fds, what, deadline)
        try:
            message = parse_json(body.decode("utf-8"), FormatError, what)
        except (UnicodeDecodeError, FormatError) as error:
            raise CacheProtocolError(f"{what}: not a JSON message: {error}") from error
        if not isinstance(message, dict):
            raise CacheProtocolError(f"{what}: a message must be a JSON object, got {type(message).__name__}")
        return message, fds
    except BaseException:
        close_all(fds)
        raise


def check_request(message: Mapping[str, object]) -> str:
    """The operation of a request, once every field is one it allows, of the type it allows.

    Example:
        >>> check_request({"op": "attach", "uri": "/m/a.safetensors", "size": None, "version": None})
        'attach'
        >>> check_request({"op": "attach", "uri": 3})
        Traceback (most recent call last):
        ...
        weightstream.errors.CacheProtocolError: attach request: 'uri' must be str, got int
    """
    op = message.get("op")
    if not isinstance(op, str) or op not in OPERATIONS:
        raise CacheProtocolError(f"unknown operation {str(op)[:40]!r}; known: {', '.join(OPERATIONS)}")
    fields = OPERATIONS[op]
    for name, value in message.items():
        if name == "op":
            continue
        if name not in fields:
            raise CacheProtocolError(f"{op} request: unknown field {name[:40]!r}")
        if (isinstance(value, bool) and bool not in fields[name]) or not isinstance(value, fields[name]):
            allowed = " or ".join("null" if kind is type(None) else kind.__name__ for kind in fields[name])
            raise CacheProtocolError(f"{op} request: {name!r} must be {allowed}, got {type(value).__name__}")
    for required in {"attach": ("uri",), "device": ("uri", "gpu"), "room": ("bytes",)}.get(op, ()):
        if required not in message:
            raise CacheProtocolError(f"{op} request: {required!r} is missing")
    return op


def error_answer(error: BaseException) -> dict[str, object]:
    """The answer that carries ``error`` to the client: its type's name, its message, its errno, and its cause."""
    number = getattr(error, "errno", None)
    if not isinstance(error, WeightstreamError):
        error = CacheError(redact(f"{type(error).__name__}: {error}"))
    answer: dict[str, object] = {"ok": False, "error": type(error).__name__, "message": str(error)}
    if isinstance(number, int):
        answer["errno"] = number
    cause = error.__cause__
    if cause is not None:
        answer["cause"] = redact(f"{type(cause).__name__}: {cause}")[:2000]
    return answer


def head_digest(data: memoryview | bytes) -> str:
    """The sha256 of the first :data:`HEAD_BYTES` of ``data``.

    Example:
        >>> head_digest(b"")[:8]
        'e3b0c442'
    """
    return hashlib.sha256(data[:HEAD_BYTES]).hexdigest()


def close_all(fds: list[int]) -> None:
    """Close every descriptor of ``fds`` (received but not kept)."""
    for fd in fds:
        os.close(fd)
    fds.clear()


def _receive_exactly(sock: socket.socket, nbytes: int, fds: list[int], what: str, deadline: float | None) -> bytes:
    chunks, received = [], 0
    while received < nbytes:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: not whole in time ({received} of {nbytes} bytes)")
            sock.settimeout(left)
        data, ancillary, flags, _ = sock.recvmsg(nbytes - received, socket.CMSG_SPACE(MAX_FDS * 4))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                descriptors = array.array("i")
                descriptors.frombytes(payload[: len(payload) - len(payload) % descriptors.itemsize])
                fds.extend(descriptors)
        if flags & socket.MSG_CTRUNC:
            raise CacheProtocolError(f"{what}: more descriptors than the {MAX_FDS} a message may carry")
        if not data:
            raise CacheUnavailableError(f"{what}: the connection closed after {received} of {nbytes} bytes")
        chunks.append(data)
        received += len(data)
    return b"".join(chunks)
