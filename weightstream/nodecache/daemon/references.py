"""Which processes use which segments: their mappings and open descriptors, read from ``/proc``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from weightstream.nodecache.protocol import KEY


def references(directory: str, ignored: frozenset[int] = frozenset()) -> dict[str, set[int]]:
    """Processes that map (or hold open) each segment in ``directory``, but the ``ignored`` ones: key -> pids.

    Example:
        >>> references("/nonexistent-cache-directory")
        {}
    """
    found: dict[str, set[int]] = {}
    prefix = os.path.join(os.path.realpath(directory), "")
    for pid in _pids():
        if pid in ignored:
            continue
        for path in _mapped_and_open(pid, prefix):
            name = os.path.basename(path).removesuffix(" (deleted)")
            if name.endswith(".seg") and KEY.match(name[:-4]):
                found.setdefault(name[:-4], set()).add(pid)
    return found


def _pids() -> Iterator[int]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def _mapped_and_open(pid: int, prefix: str) -> set[str]:
    paths = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            at = line.find(prefix)
            if at >= 0:
                paths.add(line[at:].rstrip("\n"))
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    paths.add(target)
    return paths
