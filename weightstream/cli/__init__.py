"""The ``weightstream`` command: a thin shell over the Python API (``weightstream --help``; docs/cli.md).

Its commands live beside it: ``reading`` (inspect, load), ``benching`` (bench), ``writing`` (convert, push),
``doctor``; ``cache ...`` is the node cache daemon's own (``nodecache/daemon/commands.py``). Errors the library raises
are printed in the command line's words (``wording``): ``--chunk-mib``, not ``chunk_bytes``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

import weightstream
from weightstream.arguments import parse_size
from weightstream.cli.benching import BENCH_CACHES, BENCH_DEVICES, add_bench_command
from weightstream.cli.doctor import add_doctor_command
from weightstream.cli.reading import add_reading_commands
from weightstream.cli.wording import in_flags
from weightstream.cli.writing import add_writing_commands
from weightstream.errors import WeightstreamError
from weightstream.nodecache.daemon.commands import add_cache_commands

__all__ = ["BENCH_CACHES", "BENCH_DEVICES", "main"]

LOG_ENVIRONMENT = "WEIGHTSTREAM_LOG"
"""The log level of the command (``debug``, ``info``, ``warning``, ``error``) when ``--log-level`` is not given."""
LOG_LEVELS = ("debug", "info", "warning", "error")


class Terminated(BaseException):
    """SIGTERM reached the command: it unwinds as Ctrl-C does (temporary files, segments and threads released)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 success, 1 a weightstream error, 2 usage, 130 interrupted,
    143 terminated)."""
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command that was given, with its usage, not the top level's
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    verbose = {0: None, 1: "info"}.get(args.verbose, "debug")
    default = getattr(args, "default_log_level", "warning")  # `cache serve`: info, a service's start and fills
    _log_to_stderr(args.log_level or verbose or os.environ.get(LOG_ENVIRONMENT) or default)
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main_thread else None
    try:
        return args.run(args)
    except WeightstreamError as error:
        print(f"weightstream: error: {in_flags(str(error))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("weightstream: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("weightstream: terminated", file=sys.stderr)
        return 143
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def _log_to_stderr(level: str) -> None:
    """weightstream's log lines at ``level`` and above on stderr, one line each (the library itself configures no
    logging: a program that imports it decides)."""
    if level.lower() not in LOG_LEVELS:
        print(
            f"weightstream: error: {LOG_ENVIRONMENT}={level!r}: not a log level ({', '.join(LOG_LEVELS)})",
            file=sys.stderr,
        )
        raise SystemExit(2)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("weightstream: %(levelname)s: %(message)s"))
    root = logging.getLogger("weightstream")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightstream", description="Load LLM weights at the speed of the hardware.", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"weightstream {weightstream.__version__}")
    parser.add_argument(
        "--log-level",
        "-l",
        choices=LOG_LEVELS,
        default=None,
        help=f"log lines shown on stderr (default: ${LOG_ENVIRONMENT}, else warning; info for cache serve)",
    )
    parser.add_argument(
        "--verbose",
        "-v",
        action="count",
        default=0,
        help="-v: --log-level info (what weightstream chose for you); -vv: --log-level debug",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_reading_commands(commands)
    add_bench_command(commands)
    add_writing_commands(commands)
    add_doctor_command(commands)
    add_cache_commands(commands, parse_size)
    _know_own_parser(parser)
    return parser


def _know_own_parser(parser: argparse.ArgumentParser) -> None:
    """Each command's parser as ``args.command_parser`` (the innermost given wins), for errors in its usage."""
    parser.set_defaults(command_parser=parser)
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for command in getattr(action, "choices", {}).values():
            _know_own_parser(command)


if __name__ == "__main__":
    sys.exit(main())
