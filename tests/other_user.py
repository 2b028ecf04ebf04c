"""Processes of another uid: ``setpriv --reuid/--regid`` in a mount namespace of their own, where the interpreter's
environment is reachable.

A venv (or an interpreter) under a directory another uid may not enter (root's 0700 home) cannot be run as that
uid. The command runs in a private mount namespace in which each such directory is covered with an empty tmpfs,
and only the entries the interpreter and the checkout need are bound back into it: that uid then reaches exactly
those, with its own permissions; nothing changes outside the namespace.
"""

from __future__ import annotations

import os
import shlex
import site
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534


def _needed() -> list[str]:
    """The paths the interpreter and the checkout need."""
    paths = {sys.prefix, sys.base_prefix, os.path.realpath(sys.executable), str(ROOT), *site.getsitepackages()}
    return sorted(os.path.realpath(path) for path in paths)


def _closed_parents(paths: Sequence[str]) -> dict[str, set[str]]:
    """Each directory others may not enter, with the entries in it that ``paths`` lead through (every entry, where
    the needed path is that directory itself: a checkout in a 0700 ``mktemp -d``)."""
    closed: dict[str, set[str]] = {}
    for path in paths:
        parts = Path(path).parts
        for depth in range(1, len(parts) + 1):
            directory = os.path.join(*parts[:depth])
            if os.path.isdir(directory) and not os.stat(directory).st_mode & stat.S_IXOTH:
                entries = {parts[depth]} if depth < len(parts) else set(os.listdir(directory))
                closed.setdefault(directory, set()).update(entries)
                break
    return closed


def as_user(argv: Sequence[str], uid: int = NOBODY, gid: int = NOBODY, groups: Sequence[int] = ()) -> list[str]:
    """``argv`` run as ``uid``:``gid`` with exactly the supplementary ``groups`` (none by default).

    Example:
        >>> as_user(["id"])[-2:]
        ['bash', 'id']
    """
    script = ["set -e"]
    next_fd = 10
    for directory, entries in sorted(_closed_parents(_needed()).items()):
        descriptors = {entry: next_fd + index for index, entry in enumerate(sorted(entries))}
        next_fd += len(descriptors)
        script += [f"exec {fd}<{shlex.quote(os.path.join(directory, entry))}" for entry, fd in descriptors.items()]
        script.append(f"mount -t tmpfs -o mode=0755,size=1m weightstream-test {shlex.quote(directory)}")
        for entry, fd in descriptors.items():
            target = shlex.quote(os.path.join(directory, entry))
            script += [
                f"mkdir {target}" if os.path.isdir(os.path.join(directory, entry)) else f"touch {target}",
                f"mount --no-canonicalize --bind /proc/self/fd/{fd} {target}",
                f"exec {fd}<&-",
            ]
    membership = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    script.append(f'exec setpriv --reuid {uid} --regid {gid} {" ".join(membership)} -- "$@"')
    return ["unshare", "--mount", "--propagation", "private", "bash", "-c", "\n".join(script), "bash", *argv]
