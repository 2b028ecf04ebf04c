"""etcd's v3 API through its JSON gateway (``POST /v3/kv/range`` and friends, keys and values base64): the
fleet's coordination store, spoken with the standard library.

Why not a client library: python-etcd3, the one most used, has had no release since 2020 and pins old grpcio and
protobuf; the gRPC stubs would be a dependency of the daemon for five calls. The gateway is part of every etcd
(3.4's Debian package included), speaks JSON over HTTP/1.1, and TLS where the endpoint is ``https://``.

Example:
    >>> etcd = EtcdGateway(["http://127.0.0.1:2379"])  # doctest: +SKIP
    >>> lease = etcd.grant(10)  # doctest: +SKIP
    >>> etcd.create("/weightstream/pieces/abc/0", b"node-a", lease) is None  # won  # doctest: +SKIP
    True
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import http.client
import itertools
import json
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import Self

from weightstream.errors import CacheConfigError, FleetUnavailableError

REQUEST_TIMEOUT_S = 5.0
"""A request to etcd whose connection has been silent this long fails over to the next endpoint."""
REQUEST_DEADLINE_S = 10.0
"""A request to etcd that has not been answered whole in this long fails over to the next endpoint, however its
answer trickles in (a byte every few seconds defeats the silence timeout, and would hang every fleet call)."""
EXPIRED_TIMEOUT_S = 0.001
"""What is left to each read of a request past its deadline (Linux still delivers a peer's bytes that arrive after
``shutdown``: a trickle would otherwise go on being read)."""
WATCHDOG_LINGER_S = 1.0
"""How long the deadline watchdog's thread waits for the next request before it ends (started again on demand)."""
MAX_IDLE = 8
"""Connections kept open to each endpoint between calls (threads calling at once open more, closed after)."""
MAX_TXN_KEYS = 64
"""Keys one transaction compares and deletes: etcd refuses more than 128 operations in one (``--max-txn-ops``)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class LeaseNotFound(FleetUnavailableError):
    """etcd answered that the lease named has ended (expired or revoked): nothing was written."""


def _key(key: str) -> str:
    """A key as etcd's gateway takes it (what :func:`_name` decoded from bytes that are not UTF-8 encodes back)."""
    return _b64(key.encode("utf-8", "surrogateescape"))


def _name(encoded: str) -> str:
    """A key etcd returned, as text (bytes that are not UTF-8 kept as surrogates: no key name fails to decode)."""
    return _unb64(encoded).decode("utf-8", "surrogateescape")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix`` (etcd's ``range_end`` for a prefix).

    Example:
        >>> prefix_end(b"/ws/nodes/")
        b'/ws/nodes0'
    """
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


@dataclasses.dataclass(frozen=True)
class Held:
    """A key's value, the lease that holds it (0: none) and the revision of its last change."""

    value: bytes
    lease: int
    revision: int


class _Watchdog:
    """Ends requests that run past their deadline: their socket is shut down and left no time to wait, so the
    thread reading it fails at its next read. One thread for every request of a gateway, running only while
    requests are under way (and ``WATCHDOG_LINGER_S`` after)."""

    def __init__(self) -> None:
        self._due: dict[int, tuple[float, socket.socket]] = {}
        self._expired: set[int] = set()
        self._tokens = itertools.count()
        self._wake = threading.Condition()
        self._running = False

    @contextlib.contextmanager
    def watch(self, connected: socket.socket, seconds: float) -> Iterator[None]:
        """Run the block's request on the socket ``connected``; past ``seconds``, it fails with
        :class:`TimeoutError`."""
        token = next(self._tokens)
        with self._wake:
            self._due[token] = (time.monotonic() + seconds, connected)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="weightstream-etcd-deadline", daemon=True).start()
            self._wake.notify()
        try:
            yield
        except Exception:
            if token not in self._expired:
                raise
        finally:
            with self._wake:
                self._due.pop(token, None)
                expired = token in self._expired
                self._expired.discard(token)
                self._wake.notify()  # the thread waits for the next deadline: it may be none now
        if expired:
            raise TimeoutError(f"no whole answer in {seconds:.0f} s")

    def _run(self) -> None:
        with self._wake:
            while True:
                now = time.monotonic()
                for token, (deadline, connected) in self._due.items():
                    if deadline <= now and token not in self._expired:
                        self._expired.add(token)
                        with contextlib.suppress(OSError):  # a blocked read wakes; the next finds no time left
                            connected.settimeout(EXPIRED_TIMEOUT_S)
                            connected.shutdown(socket.SHUT_RDWR)
                pending = [deadline for token, (deadline, _) in self._due.items() if token not in self._expired]
                if pending:
                    self._wake.wait(min(pending) - now)
                elif not self._wake.wait(WATCHDOG_LINGER_S) and all(token in self._expired for token in self._due):
                    self._running = False
                    return


class EtcdGateway:
    """etcd at ``endpoints`` (``http://host:port`` or ``https://``; the first that answers is used, the next on a
    failure). ``tls`` is the context for ``https://`` endpoints (a CA and, for client certificates, a key pair).

    Connections are kept open between calls (:meth:`close`, or ``with``, closes them).

    Raises (any method):
        FleetUnavailableError: no endpoint answered, or one answered with something other than etcd's JSON.
    """

    def __init__(self, endpoints: Sequence[str], tls: ssl.SSLContext | None = None) -> None:
        if not endpoints:
            raise CacheConfigError("a fleet needs at least one etcd endpoint")
        self.endpoints = [urllib.parse.urlsplit(endpoint) for endpoint in endpoints]
        for endpoint, text in zip(self.endpoints, endpoints, strict=True):
            if endpoint.scheme not in ("http", "https") or not endpoint.hostname:
                raise CacheConfigError(f"etcd endpoint {text!r}: not http://HOST:PORT or https://HOST:PORT")
        self.tls = tls
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        """Each endpoint's connections not in use, kept for the next calls (over TLS a new connection's handshake
        cost 1.25 ms of CPU here, five times the call itself, and etcd pays as much again)."""
        self._lock = threading.Lock()
        self._watchdog = _Watchdog()

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        return int(self._call("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; the seconds it has left (0: it had expired, and with it every key it held)."""
        answer = self._call("/v3/lease/keepalive", {"ID": lease})
        return int(answer.get("result", answer).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: every key it holds is deleted."""
        self._call("/v3/lease/revoke", {"ID": lease})

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        """Set ``key`` to ``value`` (held by ``lease`` if not 0)."""
        self._call("/v3/kv/put", {"key": _key(key), "value": _b64(value), "lease": lease})

    def get(self, key: str) -> bytes | None:
        """``key``'s value, or None."""
        held = self.get_held(key)
        return None if held is None else held[0]

    def get_held(self, key: str) -> tuple[bytes, int] | None:
        """``key``'s value and the lease that holds it (0: none), or None."""
        kvs = self._call("/v3/kv/range", {"key": _key(key)}).get("kvs", [])
        return (_unb64(kvs[0].get("value", "")), int(kvs[0].get("lease", 0))) if kvs else None

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` with its value."""
        return {key: held.value for key, held in self.get_range(prefix).items()}

    def get_range(self, prefix: str) -> dict[str, Held]:
        """Every key under ``prefix``, with its value, lease and revision."""
        start = prefix.encode("utf-8", "surrogateescape")
        answer = self._call("/v3/kv/range", {"key": _b64(start), "range_end": _b64(prefix_end(start))})
        return {
            _name(kv["key"]): Held(_unb64(kv.get("value", "")), int(kv.get("lease", 0)), int(kv.get("mod_revision", 0)))
            for kv in answer.get("kvs", [])
        }

    def delete(self, key: str) -> None:
        self._call("/v3/kv/deleterange", {"key": _key(key)})

    def delete_prefix(self, prefix: str) -> None:
        start = prefix.encode("utf-8", "surrogateescape")
        self._call("/v3/kv/deleterange", {"key": _b64(start), "range_end": _b64(prefix_end(start))})

    def create(self, key: str, value: bytes, lease: int = 0) -> Held | None:
        """Set ``key`` to ``value`` only if no key of that name exists (of any number of callers at once, one wins);
        None where this call did, else what the key holds (a key deleted between the two, an empty value)."""
        encoded = _key(key)
        answer = self._call(
            "/v3/kv/txn",
            {
                "compare": [{"key": encoded, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
                "success": [{"request_put": {"key": encoded, "value": _b64(value), "lease": lease}}],
                "failure": [{"request_range": {"key": encoded}}],
            },
        )
        if answer.get("succeeded"):
            return None
        ranges = [
            response["response_range"] for response in answer.get("responses", []) if "response_range" in response
        ]
        kvs = ranges[0].get("kvs", []) if ranges else []
        if not kvs:
            return Held(b"", 0, 0)
        return Held(_unb64(kvs[0].get("value", "")), int(kvs[0].get("lease", 0)), int(kvs[0].get("mod_revision", 0)))

    def replace_at(self, key: str, revision: int, value: bytes, lease: int = 0) -> bool:
        """Set ``key`` to ``value`` only if its last change is still the one at ``revision`` (what a
        :meth:`get_range` read said: of any number of callers that read it, one wins); whether this call did."""
        encoded = _key(key)
        answer = self._call(
            "/v3/kv/txn",
            {
                "compare": [{"key": encoded, "result": "EQUAL", "target": "MOD", "mod_revision": str(revision)}],
                "success": [{"request_put": {"key": encoded, "value": _b64(value), "lease": lease}}],
            },
        )
        return bool(answer.get("succeeded"))

    def delete_held(self, keys: Sequence[str], lease: int) -> None:
        """Delete each of ``keys`` that ``lease`` still holds, up to ``MAX_TXN_KEYS`` in one transaction (a key
        another lease holds now, taken over meanwhile, is left)."""
        for start in range(0, len(keys), MAX_TXN_KEYS):
            chunk = [_key(key) for key in keys[start : start + MAX_TXN_KEYS]]
            held = [{"key": key, "result": "EQUAL", "target": "LEASE", "lease": lease} for key in chunk]
            deletes = [{"request_delete_range": {"key": key}} for key in chunk]
            if self._call("/v3/kv/txn", {"compare": held, "success": deletes}).get("succeeded"):
                continue
            for compare, delete in zip(held, deletes, strict=True):  # one was taken over: each alone
                self._call("/v3/kv/txn", {"compare": [compare], "success": [delete]})

    def close(self) -> None:
        """Close the idle connections (a later call opens new ones)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, path: str, body: Mapping[str, object]) -> dict:
        """POST ``body`` to ``path`` on the first endpoint that answers; its JSON answer."""
        failures = []
        payload = json.dumps(body).encode()
        for endpoint in self.endpoints:
            try:
                response, text = self._post(endpoint, path, payload)
            except (OSError, http.client.HTTPException) as error:
                failures.append(f"{endpoint.geturl()}: {type(error).__name__}: {error}")
                continue
            try:
                answer = json.loads(text.splitlines()[0] if text else b"{}")
            except ValueError:
                raise FleetUnavailableError(
                    f"{endpoint.geturl()}{path}: HTTP {response.status}, not etcd's JSON: {text[:200]!r}"
                ) from None
            if response.status != 200 or "error" in answer:
                why = answer.get("error") or answer.get("message")
                said = f"{endpoint.geturl()}{path}: HTTP {response.status}: {why}"
                raise (LeaseNotFound if "requested lease not found" in said else FleetUnavailableError)(said)
            return answer
        raise FleetUnavailableError(f"no etcd endpoint answered {path}: {'; '.join(failures)}")

    def _post(
        self, endpoint: urllib.parse.SplitResult, path: str, payload: bytes
    ) -> tuple[http.client.HTTPResponse, bytes]:
        """The answer to ``payload`` POSTed to ``path`` on ``endpoint``, over an idle connection kept from an earlier
        call where there is one. etcd may have closed that one meanwhile: then the request was not read, and goes
        once more on a new connection."""
        with self._lock:
            idle = self._idle.get(endpoint.geturl(), [])
            connection, reused = (idle.pop(), True) if idle else (self._connect(endpoint), False)
        try:
            if connection.sock is None:
                connection.connect()
            with self._watchdog.watch(connection.sock, REQUEST_DEADLINE_S):
                connection.request("POST", path, payload, {"Content-Type": "application/json"})
                response = connection.getresponse()
                text = response.read()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            connection.close()
            if not reused:
                raise
            return self._post(endpoint, path, payload)
        except BaseException:
            connection.close()
            raise
        with self._lock:
            idle = self._idle.setdefault(endpoint.geturl(), [])
            if response.will_close or len(idle) >= MAX_IDLE:
                connection.close()
            else:
                idle.append(connection)
        return response, text

    def _connect(self, endpoint: urllib.parse.SplitResult) -> http.client.HTTPConnection:
        if endpoint.scheme == "https":
            context = self.tls or ssl.create_default_context()
            return http.client.HTTPSConnection(
                endpoint.hostname, endpoint.port or 2379, timeout=REQUEST_TIMEOUT_S, context=context
            )
        return http.client.HTTPConnection(endpoint.hostname, endpoint.port or 2379, timeout=REQUEST_TIMEOUT_S)
