"""A real cache daemon for tests: ``weightstream cache serve`` in a process of its own, on a socket and a
segment directory of the test's."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from typing_extensions import Self

ROOT = Path(__file__).resolve().parent.parent


class Daemon:
    """``with Daemon(directory, socket) as daemon:``; started listening, stopped (SIGTERM) at the end."""

    def __init__(
        self, directory: Path, socket_path: Path, *extra: str, wrap: Callable[[list[str]], list[str]] | None = None
    ) -> None:
        self.directory, self.socket = directory, socket_path
        self.extra = extra
        self.wrap = wrap
        """Makes the command run another way (as another user: ``tests.other_user.as_user``)."""
        self.process: subprocess.Popen[str] | None = None
        self.status: dict = {}
        self.log_path = socket_path.with_suffix(".log")

    def start(self) -> Daemon:
        command = [sys.executable, "-m", "weightstream.cli", "cache", "serve", "--dir", str(self.directory)]
        command += ["--socket", str(self.socket), "--json", *self.extra]
        if self.wrap is not None:
            command = self.wrap(command)
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                command, cwd="/" if self.wrap else ROOT, stdout=subprocess.PIPE, stderr=log, text=True
            )
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        if not line:
            self.process.wait(timeout=30)
            raise RuntimeError(f"the daemon did not start: {self.log()}")
        self.status = json.loads(line)
        return self

    def stop(self) -> int:
        """SIGTERM; the exit status."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=30)
        self.process.stdout.close()  # type: ignore[union-attr]
        return code

    def kill(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process.stdout.close()  # type: ignore[union-attr]

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.stop()


def places(prefix: str) -> tuple[Path, Path]:
    """A fresh segment directory and socket path on /dev/shm (short paths: a socket's is at most 107 bytes)."""
    token = secrets.token_hex(4)
    return Path(f"/dev/shm/wsc-{prefix}-{token}"), Path(f"/dev/shm/wsc-{prefix}-{token}.sock")


def remove(directory: Path, socket_path: Path) -> None:
    """What a daemon of :func:`places` leaves: its segments, its socket, its log."""
    shutil.rmtree(directory, ignore_errors=True)
    socket_path.unlink(missing_ok=True)
    socket_path.with_suffix(".log").unlink(missing_ok=True)


@contextlib.contextmanager
def running_daemon(prefix: str, *extra: str) -> Iterator[Daemon]:
    """A daemon on fresh :func:`places`, stopped and removed on leaving."""
    directory, socket_path = places(prefix)
    try:
        with Daemon(directory, socket_path, *extra) as daemon:
            yield daemon
    finally:
        remove(directory, socket_path)


def request(socket_path: Path, message: dict) -> dict:
    """The daemon's answer to ``message`` (any descriptor it carries closed); a local file an ``attach`` or ``device``
    names goes as a descriptor, as the client sends it."""
    from weightstream.nodecache.connection import CacheClient

    client = CacheClient(str(socket_path))
    try:
        names_a_file = message.get("op") in ("attach", "device")
        answer, fds = client.request_file(message) if names_a_file else client.request(message)
        for fd in fds:
            os.close(fd)
        return answer
    finally:
        client.close()


def stats(socket_path: Path) -> dict:
    """The daemon's ``stats`` answer."""
    return request(socket_path, {"op": "stats"})
