"""What a fill may use: the room left in the budget's filesystem, the machine's memory and the daemon's memory
cgroup (v1 or v2), and the huge-page policy of the tmpfs segments live on."""

from __future__ import annotations

import contextlib
import os

from weightstream.errors import logger

log = logger(__name__)

MEMORY_RESERVE_BYTES = 256 << 20
"""Left free when checking a fill against the memory available and the cgroup's limit."""


def tmpfs_huge_pages(directory: str) -> str | None:
    """The ``huge=`` option of the tmpfs that holds ``directory`` (``never`` when the mount says nothing), or
    ``None`` when it is not a tmpfs.

    Example:
        >>> tmpfs_huge_pages("/dev/shm") in ("never", "always", "within_size", "advise", None)
        True
    """
    target = os.path.realpath(directory)
    best: tuple[str, str, str] | None = None
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            separator = fields.index("-")
            point, kind, options = fields[4], fields[separator + 1], fields[separator + 3]
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and (best is None or len(point) > len(best[0])):
                best = (point, kind, options)
    if best is None or best[1] != "tmpfs":
        return None
    return next((option[5:] for option in best[2].split(",") if option.startswith("huge=")), "never")


def mem_available() -> int | None:
    with contextlib.suppress(OSError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


CGROUP_UNLIMITED = 1 << 62
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1: any limit above this is none."""


def cgroup_room(cgroup_file: str = "/proc/self/cgroup", mount: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup may still be charged: the least room (limit less usage) of its cgroup and
    each ancestor that has a limit, cgroup v2 (``memory.max``, ``memory.current``) or v1 (``memory.limit_in_bytes``,
    ``memory.usage_in_bytes``); None where none is limited or the files cannot be read.

    Example:
        >>> room = cgroup_room()
        >>> room is None or isinstance(room, int)
        True
    """
    try:
        with open(cgroup_file) as cgroup:
            entries = [line.rstrip("\n").split(":", 2) for line in cgroup if line.count(":") >= 2]
    except OSError:
        return None
    v1 = next((path for _, controllers, path in entries if "memory" in controllers.split(",")), None)
    if v1 is not None:
        top, path, names = os.path.join(mount, "memory"), v1, ("memory.limit_in_bytes", "memory.usage_in_bytes")
    else:
        v2 = next((path for hierarchy, controllers, path in entries if hierarchy == "0" and not controllers), None)
        if v2 is None:
            return None
        top, path, names = mount, v2, ("memory.max", "memory.current")
    rooms = []
    directory = os.path.normpath(os.path.join(top, path.lstrip("/")))
    while True:
        room = _room_of(directory, *names)
        if room is not None:
            rooms.append(room)
        if directory == top or not directory.startswith(top):
            break
        directory = os.path.dirname(directory)
    return min(rooms, default=None)


def _room_of(directory: str, limit_name: str, usage_name: str) -> int | None:
    """A cgroup's limit less its usage, or None without a limit (or files to say)."""
    try:
        with open(os.path.join(directory, limit_name)) as limit_file:
            limit = limit_file.read().strip()
        if limit == "max" or int(limit) >= CGROUP_UNLIMITED:
            return None
        with open(os.path.join(directory, usage_name)) as usage_file:
            return int(limit) - int(usage_file.read())
    except (OSError, ValueError):
        return None


def clamp_budget(budget: int, directory: str) -> int:
    """``budget``, or less where the machine's memory or the filesystem ``directory`` is on (or will be on) cannot
    hold that much: clamped to the smaller, with a warning.

    Example:
        >>> clamp_budget(1 << 20, "/dev/shm")
        1048576
    """
    limits = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                limits["the machine's memory (MemTotal)"] = int(line.split()[1]) * 1024
    existing = directory
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    with contextlib.suppress(OSError):
        filesystem = os.statvfs(existing)
        limits[f"the filesystem of {directory}"] = filesystem.f_blocks * filesystem.f_frsize
    for what, limit in limits.items():
        if budget > limit:
            log.warning("--budget %d is more than %s holds (%d bytes): clamped to it", budget, what, limit)
            budget = limit
    return budget
