"""A node cache daemon of the benchmark's own: started, filled, stopped."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence

from weightstream.errors import CacheError


@contextlib.contextmanager
def daemon_process(
    directory: str, socket_path: str, prefetch: str | None = None, serve_options: Sequence[str] = ()
) -> Iterator[subprocess.Popen[str]]:
    """A ``weightstream cache serve`` process of the caller's own (with ``serve_options``, e.g. ``--device cuda:0``),
    listening when entered (and holding the checkpoint ``prefetch`` names, if given); stopped with SIGTERM and its
    directory removed on leaving. For benchmarks.

    Raises:
        CacheError: the daemon did not start, or could not be filled.

    Example:
        >>> with daemon_process("/dev/shm/my-cache", "/tmp/c.sock", prefetch="model/"):  # doctest: +SKIP
        ...     weightstream.load_weights("model/", cache="/tmp/c.sock")
    """
    command = [sys.executable, "-m", "weightstream.cli", "cache"]
    serve = [*command, "serve", "--dir", directory, "--socket", socket_path, "--json", *serve_options]
    daemon = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if not daemon.stdout.readline():  # type: ignore[union-attr]  # its status line: it listens
            raise CacheError(f"the cache daemon for {socket_path} did not start (exit {daemon.wait(timeout=60)})")
        if prefetch is not None:
            filled = subprocess.run(
                [*command, "prefetch", prefetch, "--socket", socket_path, "--json"],
                capture_output=True,
                text=True,
                check=False,
            )
            if filled.returncode != 0:
                raise CacheError(
                    f"the cache daemon could not be filled with {prefetch}: {filled.stderr.strip()[-500:]}"
                )
        yield daemon
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        daemon.stdout.close()  # type: ignore[union-attr]
        shutil.rmtree(directory, ignore_errors=True)
