"""The node cache daemon's socket, from the client's side: where it is (``cache=PATH``, or ``cache="auto"`` =
``$WEIGHTSTREAM_CACHE`` or :func:`default_socket`), that a trusted user serves it (``SO_PEERCRED``), and one
connection's requests and answers (:class:`CacheClient`), the daemon's errors raised as their own types."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import select
import socket
import struct
import threading
from collections.abc import Mapping

from weightstream import errors
from weightstream.errors import CacheError, CacheRefusedError, CacheUnavailableError, logger
from weightstream.nodecache.protocol import MAX_ANSWER_BYTES, close_all, receive, send
from weightstream.sources.local.regular import open_regular

log = logger(__name__)

ENVIRONMENT = "WEIGHTSTREAM_CACHE"
"""The variable naming the daemon's socket for ``cache="auto"``."""
OWNER_ENVIRONMENT = "WEIGHTSTREAM_CACHE_UID"
"""The variable naming a daemon's user (besides this process's own and root) whose bytes a client accepts."""
PEER_CREDENTIALS = struct.Struct("3i")
CONNECT_TIMEOUT_S = 5.0
ROOT_SOCKET = "/run/weightstream/cache.sock"
"""Where root's daemon listens by default: the node's own, which members of its ``--group`` use without naming it."""
ANSWER_TIMEOUT_S = 3600.0
"""An attach waits for a fill, which may read a large file from a slow store."""


def default_socket() -> str:
    """Where the daemon listens unless told otherwise, in a directory no other user can create first:
    ``$XDG_RUNTIME_DIR/weightstream-cache.sock``, else ``/run/weightstream/cache.sock`` for root, else
    ``/tmp/weightstream-<uid>/cache.sock`` (the daemon makes that directory, owner-only; a client refuses it if
    another user made it).

    Example:
        >>> default_socket().endswith(".sock")
        True
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "weightstream-cache.sock")
    if os.getuid() == 0:
        return ROOT_SOCKET
    return f"/tmp/weightstream-{os.getuid()}/cache.sock"


def own_socket() -> str:
    """Where this user's daemon listens unless told otherwise: ``$WEIGHTSTREAM_CACHE``, else :func:`default_socket`
    (a daemon never takes root's socket as a client may).

    Example:
        >>> own_socket().endswith(".sock")
        True
    """
    return os.environ.get(ENVIRONMENT) or default_socket()


def trusted_uids() -> set[int]:
    """The users a client takes a daemon's bytes from: itself, root, and the one ``$WEIGHTSTREAM_CACHE_UID`` names
    (a uid or a user name: a daemon run as a dedicated user).

    Raises:
        CacheRefusedError: ``$WEIGHTSTREAM_CACHE_UID`` names no user.

    Example:
        >>> {0, os.getuid()} <= trusted_uids()
        True
    """
    trusted = {0, os.getuid()}
    named = os.environ.get(OWNER_ENVIRONMENT, "").strip()
    if named:
        try:
            trusted.add(int(named) if named.isdigit() else pwd.getpwnam(named).pw_uid)
        except KeyError:
            raise CacheRefusedError(f"${OWNER_ENVIRONMENT}={named[:64]!r}: no such user") from None
    return trusted


def resolve_socket(cache: str) -> tuple[str, bool]:
    """The socket ``cache`` names and whether it was asked for explicitly (``"auto"`` is not): for ``"auto"``,
    ``$WEIGHTSTREAM_CACHE``, else this user's default socket, else (where that does not exist) root's, the node's
    daemon, whose ``--group`` members use it so.

    Example:
        >>> resolve_socket("/run/ws.sock")
        ('/run/ws.sock', True)
    """
    if cache == "auto":
        named = os.environ.get(ENVIRONMENT)
        if named:
            return named, False
        own = own_socket()
        if not os.path.lexists(own) and os.path.lexists(ROOT_SOCKET):  # the node's daemon, run as root (--group)
            return ROOT_SOCKET, False
        return own, False
    return cache, True


class CacheClient:
    """One connection to the daemon, checked to be served by a trusted user (:func:`trusted_uids`); requests on it
    are serialised (one at a time)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._socket = _connect(path)

    def request(self, message: Mapping[str, object], fds: tuple[int, ...] = ()) -> tuple[dict[str, object], list[int]]:
        """Send ``message`` (with ``fds``); the answer and its descriptors (the caller closes them). A connection the
        daemon closed before the request (it drops clients silent for a while, or it restarted) is opened again;
        a request that reached the daemon is never sent twice.

        Raises:
            the typed error the daemon answered with (its class, message and errno; its cause as ``__cause__``).
            CacheUnavailableError: the daemon went away before answering.
        """
        with self._lock:
            if _closed_by_peer(self._socket):
                self._reconnect()
            answer, received = self._exchange(message, fds)
        if answer.get("ok") is True:
            return answer, received
        close_all(received)
        raise _typed_error(answer, self.path)

    def attach(
        self,
        uri: str,
        size: int | None = None,
        version: str | None = None,
        storage_options: Mapping[str, object] | None = None,
    ) -> tuple[dict[str, object], list[int]]:
        """Ask for the segment of ``uri`` (at ``version``, of ``size`` bytes, if given): the answer and its descriptor
        (the caller closes it). The daemon fills the segment first if it has none. A local file is opened here, with
        this process's rights, and passed to the daemon as a descriptor: the daemon reads what this process can.

        Raises:
            NotFound, SourceError, UnsupportedInputError: a local file this process cannot open (or not a regular
                file); the daemon's typed errors otherwise.
        """
        message = {"op": "attach", "uri": uri, "size": size, "version": version}
        return self.request_file({**message, "storage_options": dict(storage_options or {})})

    def request_file(self, message: Mapping[str, object]) -> tuple[dict[str, object], list[int]]:
        """:meth:`request` of a message naming a file (``uri``): a local one is opened here and goes as a
        descriptor, its path made absolute (the daemon has a working directory of its own)."""
        uri = daemon_uri(str(message["uri"]))
        if "://" in uri:
            try:
                return self.request(message)
            except errors.SourceError as error:  # its message names the object; say who read it, and as whom
                said = (
                    f"{error} (read by the cache daemon at {self.path}, with the daemon's own environment and "
                    "credentials unless storage_options sent this process's)"
                )
                error.args = (said, *error.args[1:])
                raise
        fd, _ = open_regular(uri)
        try:
            return self.request({**message, "uri": uri}, (fd,))
        finally:
            os.close(fd)

    def close(self) -> None:
        self._socket.close()

    def _reconnect(self) -> None:
        self._socket.close()
        self._socket = _connect(self.path)

    def _exchange(self, message: Mapping[str, object], fds: tuple[int, ...]) -> tuple[dict[str, object], list[int]]:
        """One request and its answer. A daemon that closed the connection may have said why first (a refused
        client): that answer is read even when sending failed; without one, the request never reached a daemon and
        is sent once more on a new connection."""
        what = f"the answer of the cache daemon at {self.path}"
        try:
            send(self._socket, message, fds)
        except (BrokenPipeError, ConnectionResetError):
            with contextlib.suppress(OSError, CacheUnavailableError):
                return receive(self._socket, MAX_ANSWER_BYTES, what)
            try:
                self._reconnect()
                send(self._socket, message, fds)
            except OSError as again:
                raise CacheUnavailableError(f"the cache daemon at {self.path} closed the connection") from again
        try:
            return receive(self._socket, MAX_ANSWER_BYTES, what)
        except TimeoutError as error:
            raise CacheUnavailableError(
                f"the cache daemon at {self.path} did not answer in {ANSWER_TIMEOUT_S:.0f} s"
            ) from error
        except ConnectionResetError as error:
            raise CacheUnavailableError(f"the cache daemon at {self.path} reset the connection") from error


def daemon_uri(uri: str) -> str:
    """``uri`` as the daemon names it: a local path (``file://`` or not) made absolute (the daemon has a working
    directory of its own; the file itself goes as a descriptor), any other URI as it is.

    Example:
        >>> daemon_uri("s3://bucket/model.safetensors"), daemon_uri("file:///m/model.safetensors")
        ('s3://bucket/model.safetensors', '/m/model.safetensors')
    """
    path = uri.removeprefix("file://")
    return path if "://" in path else os.path.abspath(path)


def _connect(path: str) -> socket.socket:
    """A connection to the daemon at ``path``, once the kernel says a trusted user serves it (``SO_PEERCRED``).

    Raises:
        CacheUnavailableError: nothing listens there.
        CacheRefusedError: another user listens there (a socket squatted before the daemon started), or this user
            may not connect (not in the daemon's group: the message says whose the socket is).
    """
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    connection.settimeout(CONNECT_TIMEOUT_S)
    try:
        connection.connect(path)
        pid, uid, _ = PEER_CREDENTIALS.unpack(
            connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size)
        )
        trusted = trusted_uids()
    except PermissionError as error:
        connection.close()
        raise CacheRefusedError(f"{path}: {_not_allowed(path, error)}") from error
    except OSError as error:
        connection.close()
        reason = "no such socket" if error.errno == errno.ENOENT else (error.strerror or str(error))
        raise CacheUnavailableError(f"no weightstream cache daemon at {path}: {reason}") from error
    except BaseException:
        connection.close()
        raise
    if uid not in trusted:
        connection.close()
        raise CacheRefusedError(
            f"{path}: the process listening there is uid {uid} (pid {pid}), not this user (uid {os.getuid()}), root "
            f"or ${OWNER_ENVIRONMENT}: its bytes are not taken"
        )
    connection.settimeout(ANSWER_TIMEOUT_S)
    return connection


def _not_allowed(path: str, error: OSError) -> str:
    """Why this user may not connect to the socket at ``path`` (its owner, group and mode, or its directory's)."""
    for place in (path, os.path.dirname(path)):
        try:
            status = os.stat(place)
        except OSError:
            continue
        if place == path or not os.access(place, os.X_OK):
            return (
                f"a cache daemon's socket, but uid {os.getuid()} may not connect ({error.strerror}): not in the "
                f"daemon's group ({'the socket' if place == path else 'its directory ' + place} is "
                f"{_user(status.st_uid)}:{_group(status.st_gid)}, mode {status.st_mode & 0o7777:o}); ask to be added "
                "to that group, or run a daemon of your own"
            )
    return f"this user may not connect ({error.strerror})"


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _closed_by_peer(connection: socket.socket) -> bool:
    """Whether the daemon closed ``connection`` (or sent something unasked) since the last answer."""
    readable, _, _ = select.select([connection], [], [], 0)
    return bool(readable)  # an end of file, a reset, or bytes unasked for: a fresh connection in every case


def find_daemon(cache: str) -> str:
    """The socket of the daemon ``cache`` names (``"auto"``: ``$WEIGHTSTREAM_CACHE`` or the default), once one
    answers there.

    Raises:
        CacheUnavailableError: no daemon answers there.
        CacheRefusedError: another user listens there.

    Example:
        >>> find_daemon("/nonexistent/cache.sock")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        weightstream.errors.CacheUnavailableError: no weightstream cache daemon at /nonexistent/cache.sock: no such ...
    """
    path, _ = resolve_socket(cache)
    CacheClient(path).close()
    return path


def connect(cache: str) -> tuple[CacheClient | None, str | None]:
    """A client of the daemon ``cache`` names, or, for ``"auto"`` when none can be used, None and why (logged).

    Raises:
        CacheUnavailableError: an explicitly named socket has no daemon.
        CacheRefusedError: an explicitly named socket is another user's, or this user may not connect to it.
    """
    path, explicit = resolve_socket(cache)
    try:
        return CacheClient(path), None
    except CacheRefusedError as error:
        if explicit or not isinstance(error.__cause__, PermissionError):
            raise
        log.warning("cache='auto': %s; reading from the source", error)
        return None, str(error)
    except CacheUnavailableError as error:
        if explicit:
            raise
        # No socket is the usual case on a machine without the daemon: said only at DEBUG. Anything else (a
        # stale socket of a daemon that died, one that does not answer) is a warning at every load: the node is
        # meant to have a cache and every load now reads its source.
        # One $WEIGHTSTREAM_CACHE names that is not there is said at INFO: someone configured it.
        absent = isinstance(error.__cause__, FileNotFoundError)
        level = (logging.INFO if os.environ.get(ENVIRONMENT) else logging.DEBUG) if absent else logging.WARNING
        log.log(level, "cache='auto': %s; reading from the source", error)
        return None, str(error)


def _typed_error(answer: Mapping[str, object], path: str) -> Exception:
    """The error the daemon's answer carries, as its own type (a ``CacheError`` for a type this package does not
    know), with its errno and, as ``__cause__``, what caused it in the daemon."""
    name, message = answer.get("error"), answer.get("message")
    text = f"{message}" if isinstance(message, str) else f"the cache daemon at {path} answered {dict(answer)!r:.300}"
    kind = getattr(errors, name, None) if isinstance(name, str) else None
    if isinstance(kind, type) and issubclass(kind, errors.WeightstreamError):
        error: Exception = kind(text)
    else:
        error = CacheError(f"cache daemon at {path}: {text}")
    number = answer.get("errno")
    if isinstance(number, int) and not isinstance(number, bool):
        error.errno = number  # type: ignore[attr-defined]
    cause = answer.get("cause")
    if isinstance(cause, str):
        error.__cause__ = CacheError(f"in the cache daemon at {path}: {cause}")
    return error
