"""The daemon's end of its socket: made where only its user could (a stale socket of that user replaced, nothing
else ever removed), listened on for its user (and a group), and who is at the other end of each connection, as the
kernel vouches for it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import stat
import struct

from weightstream.errors import CacheConfigError, CacheInUseError
from weightstream.nodecache.daemon.directory import own_directory

CREDENTIALS = struct.Struct("3i")
"""``struct ucred``: pid, uid, gid."""
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
"""The peer's supplementary groups when it connected (Linux 4.13+)."""
MAX_GROUPS = 65536


@dataclasses.dataclass(frozen=True)
class Peer:
    """A connected client, as the kernel vouches for it (``SO_PEERCRED``, ``SO_PEERGROUPS``) when it connected."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]

    @property
    def owner(self) -> bool:
        """Whether it runs as the daemon's own user: only then does the daemon read with its own rights for it."""
        return self.uid == os.getuid()


def peer_of(connection: socket.socket) -> Peer:
    """Who is at the other end of ``connection``."""
    pid, uid, gid = CREDENTIALS.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, CREDENTIALS.size))
    try:
        raw = connection.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * MAX_GROUPS)
        groups = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError:  # a kernel before 4.13: the groups the process has now
        groups = frozenset(supplementary_groups(pid))
    return Peer(pid, uid, gid, groups)


def listen(path: str, group: int | None) -> tuple[socket.socket, tuple[int, int]]:
    """A listening socket at ``path``, owner-only (or owner and ``group``), and the identity of its file. A stale
    socket of this user's (nobody listens) is replaced; anything else at ``path`` is refused, never removed."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        status = None
    if status is not None:
        if not stat.S_ISSOCK(status.st_mode):
            raise CacheConfigError(f"--socket {path}: a file that is not a socket is there; it is left alone")
        if status.st_uid != os.getuid():
            raise CacheConfigError(f"--socket {path}: a socket of uid {status.st_uid} is there; it is left alone")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a daemon that died left it
        else:
            raise CacheInUseError(f"--socket {path}: another cache daemon is listening there")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    previous = os.umask(0o177 if group is None else 0o117)
    try:
        listener.bind(path)
    except OSError as error:
        listener.close()
        raise CacheConfigError(f"--socket {path}: cannot listen there: {error.strerror}") from error
    finally:
        os.umask(previous)
    if group is not None:
        try:
            os.chown(path, -1, group)
        except OSError as error:
            listener.close()
            os.unlink(path)
            raise CacheConfigError(
                f"--group {group}: cannot give the socket to that group: {error.strerror} (the daemon's user must be "
                "a member of it)"
            ) from error
    listener.listen(128)
    listener.settimeout(0.2)
    bound = os.lstat(path)
    return listener, (bound.st_dev, bound.st_ino)


def unlink_if_ours(path: str, bound: tuple[int, int]) -> None:
    """Remove the socket file this daemon bound, unless something else has taken its place."""
    with contextlib.suppress(OSError):
        status = os.lstat(path)
        if (status.st_dev, status.st_ino) == bound:
            os.unlink(path)


def supplementary_groups(pid: int) -> set[int]:
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Groups:"):
                return {int(group) for group in line.split()[1:]}
    return set()


def socket_directory(path: str, group: int | None) -> None:
    """Make the default socket's directory (owner-only; others may pass through to the socket with ``group``,
    whose own mode admits that group alone), or check the one there: no other user can put a socket where clients
    look."""
    own_directory(path, path, "the socket's directory", 0o700 if group is None else 0o711)
