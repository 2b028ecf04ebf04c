"""The daemon's own directory: created by it (or empty when first given), marked as a cache directory, owned by
the daemon's user, writable by it alone, and locked for the daemon's lifetime.

The daemon removes files only in a directory it owns this way, and only files of its own naming (segments,
manifests, temporary fills): a directory of a user's notes, checkpoints or configs given by mistake is refused,
never emptied. A second daemon on the same directory gets :class:`CacheInUseError` naming the first's pid (the
lock is an ``flock`` on the marker: it goes with the process, ``kill -9`` included).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat

from weightstream.errors import CacheConfigError, CacheInUseError

MARKER = ".weightstream-cache"
"""The file that marks a directory as a cache directory; it holds the owner's uid and the running daemon's pid."""
CACHE_FILE = re.compile(r"^(?:[0-9a-f]{32}\.(?:seg|json)|tmp-[0-9a-f]{32}(?:-\d+-\d+|\.json))$")
"""The names the daemon gives its files: segments, manifests and their temporary forms."""


def default_directory() -> str:
    """Where segments live unless told otherwise: ``/dev/shm/weightstream-cache-<uid>`` (a tmpfs).

    Example:
        >>> default_directory().startswith("/dev/shm/weightstream-cache-")
        True
    """
    return f"/dev/shm/weightstream-cache-{os.getuid()}"


def in_use(directory: str) -> bool:
    """Whether a daemon runs on cache ``directory`` now (holds its marker's lock; a dead one's lock went with it).

    Example:
        >>> import tempfile
        >>> place = tempfile.mkdtemp()
        >>> claimed = CacheDirectory(place)
        >>> in_use(place), claimed.release(), in_use(place)
        (True, None, False)
    """
    try:
        fd = os.open(os.path.join(directory, MARKER), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def is_cache_file(name: str) -> bool:
    """Whether ``name`` is one the daemon gives its files (only those are ever removed).

    Example:
        >>> is_cache_file("0123456789abcdef0123456789abcdef.seg"), is_cache_file("notes.txt")
        (True, False)
    """
    return CACHE_FILE.match(name) is not None


def own_directory(path: str, where: str, what: str, mode: int = 0o700) -> None:
    """Make the directory ``path`` (with ``mode``), or check that the one there is a directory of this user's that
    only it may write. ``where`` and ``what`` name it in errors.

    Raises:
        CacheConfigError: it cannot be made, is no directory, belongs to another user or others may write it.

    Example:
        >>> own_directory("/", "--dir /", "the cache directory")  # doctest: +SKIP
    """
    try:
        os.mkdir(path, mode)
        os.chmod(path, mode)  # whatever the umask took away
    except FileExistsError:
        pass
    except OSError as error:
        raise CacheConfigError(f"{where}: cannot create {what}: {error.strerror}") from error
    try:
        status = os.lstat(path)
    except OSError as error:
        raise CacheConfigError(f"{where}: {error.strerror}") from error
    if not stat.S_ISDIR(status.st_mode):
        raise CacheConfigError(f"{where}: is not a directory")
    if status.st_uid != os.getuid() or status.st_mode & 0o022:
        raise CacheConfigError(
            f"{where}: {what} must belong to this user (uid {os.getuid()}) and be writable by it alone; it is uid "
            f"{status.st_uid}, mode {oct(status.st_mode & 0o777)}"
        )


class CacheDirectory:
    """``directory`` claimed for this process until :meth:`release` (see the module's description).

    Raises:
        CacheConfigError: the path is not a directory, belongs to another user, is writable by others, or holds
            files without being a cache directory.
        CacheInUseError: another daemon holds it.

    Example:
        >>> import tempfile
        >>> claimed = CacheDirectory(tempfile.mkdtemp())
        >>> os.path.basename(claimed.marker)
        '.weightstream-cache'
        >>> claimed.release()
    """

    def __init__(self, directory: str) -> None:
        self.path = directory
        self.marker = os.path.join(directory, MARKER)
        own_directory(directory, f"--dir {directory}", "the cache directory")
        if not os.path.exists(self.marker) and not all(is_cache_file(name) for name in os.listdir(directory)):
            raise CacheConfigError(
                f"--dir {directory}: holds files but is not a weightstream cache directory (no {MARKER}); give a new "
                f"or empty directory: the daemon removes what it does not recognise in its own"
            )
        self._fd = os.open(self.marker, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CacheInUseError(
                    f"--dir {directory}: in use by the cache daemon pid {self._holder()}; stop it first, or give "
                    f"another directory"
                ) from None
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, json.dumps({"owner": os.getuid(), "pid": os.getpid()}).encode(), 0)
        except BaseException:
            os.close(self._fd)
            raise

    def release(self) -> None:
        """Give the directory up (its segments stay, for the next daemon to adopt)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _holder(self) -> str:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            return str(int(json.loads(os.pread(self._fd, 4096, 0))["pid"]))
        return "(unknown)"
