"""``weightstream cache serve | ls | stats | evict | prefetch | stop``: the daemon and its controls."""

from __future__ import annotations

import argparse
import contextlib
import grp
import json
import logging
import sys
from collections.abc import Callable

from weightstream.errors import CacheError, DeviceUnavailableError
from weightstream.nodecache.client import CacheClient, default_socket, resolve_socket
from weightstream.nodecache.daemon.server import default_directory, run_daemon
from weightstream.nodecache.protocol import close_all
from weightstream.progress import ProgressBar


def add_cache_commands(
    commands: argparse._SubParsersAction,  # type: ignore[type-arg]
    parse_size: Callable[[str], int],
) -> None:
    """Add ``cache`` and its subcommands to the ``weightstream`` parser."""
    cache = commands.add_parser("cache", help="the node weight cache: a daemon holding weights in shared memory")
    actions = cache.add_subparsers(dest="cache_command", required=True)
    serve = actions.add_parser("serve", help="run the daemon in the foreground (SIGTERM stops it)")
    serve.add_argument(
        "--dir", default=default_directory(), help=f"where segments live (default {default_directory()})"
    )
    serve.add_argument(
        "--socket", default=None, help=f"where to listen (default $WEIGHTSTREAM_CACHE or {default_socket()})"
    )
    serve.add_argument("--budget", type=parse_size, default=None, help="most bytes held (default: as memory allows)")
    serve.add_argument("--group", default=None, help="also serve this group's processes (name or gid)")
    serve.add_argument("--json", action="store_true", help="print the daemon's status as JSON once it listens")
    serve.add_argument(
        "--huge-pages",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: ask for huge pages (a tmpfs mounted huge=always or huge=advise gives them); on: refuse to start "
        "on a filesystem without them; off: 4 KiB pages",
    )
    serve.add_argument(
        "--device",
        action="append",
        default=None,
        metavar="cuda:N",
        help="also keep device copies on this GPU, which clients there map without copying (repeatable; needs "
        "cuda-python)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=10.0,
        help="seconds a client may stay silent mid-conversation (default 10)",
    )
    serve.set_defaults(run=_serve)
    for name, text in (("ls", "list the entries"), ("stats", "the daemon's counters"), ("stop", "stop the daemon")):
        action = actions.add_parser(name, help=text)
        _add_socket(action)
        action.set_defaults(run=_simple, op=name)
    evict = actions.add_parser("evict", help="remove an entry (or every unreferenced one)")
    evict.add_argument("key", nargs="?", default=None)
    _add_socket(evict)
    evict.set_defaults(run=_simple, op="evict")
    prefetch = actions.add_parser("prefetch", help="fill the cache with a checkpoint before its engine starts")
    prefetch.add_argument("uri")
    prefetch.add_argument("--format", default="auto")
    prefetch.add_argument(
        "--device",
        default=None,
        metavar="cuda:N",
        help="also have the daemon make its copies on this GPU (a daemon started with --device for it)",
    )
    _add_socket(prefetch)
    prefetch.set_defaults(run=_prefetch)


def _add_socket(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket", default=None, help="the daemon's socket (default $WEIGHTSTREAM_CACHE or the default)"
    )
    parser.add_argument("--json", action="store_true")


def _socket(args: argparse.Namespace) -> str:
    return resolve_socket(args.socket or "auto")[0]


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s weightstream-cache %(levelname)s %(message)s")
    group = (
        None if args.group is None else (int(args.group) if args.group.isdigit() else grp.getgrnam(args.group).gr_gid)
    )
    return run_daemon(
        args.dir,
        _socket(args),
        args.budget,
        group=group,
        status=args.json,
        idle_timeout_s=args.idle_timeout,
        huge_pages=args.huge_pages,
        devices=args.device,
    )


def _simple(args: argparse.Namespace) -> int:
    client = CacheClient(_socket(args))
    try:
        message: dict[str, object] = {"op": args.op}
        if args.op == "evict":
            message["key"] = args.key
        answer, _ = client.request(message)
    finally:
        client.close()
    answer.pop("ok", None)
    if args.json:
        print(json.dumps(answer))
    elif args.op == "ls":
        for entry in answer["entries"]:  # type: ignore[attr-defined]
            print(f"{entry['key']}  {entry['size']:>14}  refs {len(entry['references']):>3}  {entry['uri']}")
    else:
        print("\n".join(f"{key}: {value}" for key, value in answer.items()))
    return 0


def _prefetch(args: argparse.Namespace) -> int:
    import weightstream

    with weightstream.open(args.uri, args.format, filter=()) as planned:
        files = [(spec.path, spec.size) for spec in planned.plan.files]
    total = sum(size for _, size in files)
    bar = ProgressBar(label="prefetch") if sys.stderr.isatty() and not args.json else None
    client = CacheClient(_socket(args))
    keys = []
    gpus: object = []
    try:
        with contextlib.nullcontext() if bar is None else bar.expecting(total):
            for path, size in files:
                answer, fds = client.attach(path)
                close_all(fds)
                keys.append(answer["key"])
                gpus = answer.get("gpus")
                if bar is not None:
                    bar.advance(size)
    finally:
        client.close()
    if args.device is not None:
        _prefetch_device(args, gpus)
    result = {"uri": args.uri, "files": len(files), "bytes": total, "keys": keys, "device": args.device}
    print(json.dumps(result) if args.json else f"cached {len(files)} files, {total / 2**30:.3f} GiB of {args.uri}")
    return 0


def _prefetch_device(args: argparse.Namespace, gpus: object) -> None:
    """Have the daemon copy the checkpoint to ``args.device``: opening it through the cache for that GPU attaches
    every file with its device copy (made on the first request)."""
    import torch

    import weightstream
    from weightstream.nodecache.vmm import gpu_uuid

    device = torch.device(args.device)
    if device.type != "cuda":
        raise DeviceUnavailableError(f"--device {args.device!r}: name a GPU as cuda:N")
    uuid = gpu_uuid(device.index if device.index is not None else 0)
    if not isinstance(gpus, list) or uuid not in gpus:
        raise CacheError(
            f"the cache daemon keeps no device copies on {args.device} ({uuid}); it serves {gpus or 'none'}"
        )
    with weightstream.open(args.uri, args.format, filter=(), cache=_socket(args), device=args.device):
        pass
