"""``weightstream cache serve | ls | stats | evict | prefetch | stop``: the daemon and its controls."""

from __future__ import annotations

import argparse
import contextlib
import grp
import hashlib
import json
import math
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from weightstream.arguments import add_storage_arguments, storage_options
from weightstream.errors import CacheConfigError, CacheError, redact
from weightstream.nodecache.connection import ENVIRONMENT, default_socket, own_socket
from weightstream.nodecache.daemon.directory import default_directory, in_use
from weightstream.nodecache.daemon.endpoint import socket_directory
from weightstream.nodecache.daemon.limits import clamp_budget
from weightstream.progress import ProgressBar
from weightstream.terminal import printable

if TYPE_CHECKING:
    from weightstream.checkpoint.node_cache import NodeCache
    from weightstream.nodecache.daemon.fleet.node import FleetNode


def add_cache_commands(
    commands: argparse._SubParsersAction,  # type: ignore[type-arg]
    parse_size: Callable[[str], int],
) -> None:
    """Add ``cache`` and its subcommands to the ``weightstream`` parser."""
    cache = commands.add_parser(
        "cache", allow_abbrev=False, help="the node weight cache: a daemon holding weights in shared memory"
    )
    actions = cache.add_subparsers(dest="cache_command", required=True)
    serve = actions.add_parser("serve", allow_abbrev=False, help="run the daemon in the foreground (SIGTERM stops it)")
    serve.add_argument(
        "--dir", default=default_directory(), help=f"where segments live (default {default_directory()})"
    )
    serve.add_argument(
        "--socket", default=None, help=f"where to listen (default $WEIGHTSTREAM_CACHE or {default_socket()})"
    )
    serve.add_argument("--budget", type=parse_size, default=None, help="most bytes held (default: as memory allows)")
    serve.add_argument(
        "--group",
        default=None,
        help="also serve this group's processes (name or gid); they read only what they could read themselves",
    )
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
        "--device-budget",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="most bytes of copies kept on each --device GPU, least recently used evicted first (default: as many as "
        "fit)",
    )
    serve.add_argument(
        "--fleet",
        action="append",
        default=None,
        metavar="etcd://HOST:PORT/PREFIX",
        help="fill remote files with the other caches of this etcd prefix, over NIXL (repeatable: one per etcd "
        "member; etcds:// for TLS; needs weightstream[fleet])",
    )
    serve.add_argument("--fleet-node", default=None, help="this node's name in the fleet (default: the host name)")
    serve.add_argument("--fleet-ca", default=None, metavar="PEM", help="etcds://: the CA to trust")
    serve.add_argument("--fleet-cert", default=None, metavar="PEM", help="etcds://: this node's client certificate")
    serve.add_argument("--fleet-key", default=None, metavar="PEM", help="etcds://: its private key")
    serve.add_argument(
        "--fleet-transfer-timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="seconds one piece's transfer from a peer may take before the fill gives it up and fills a fresh file "
        "from the origin (default 30)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=_seconds,
        default=10.0,
        help="seconds within which a client's request must arrive whole (default 10)",
    )
    serve.add_argument(
        "--stop-timeout",
        type=_seconds,
        default=30.0,
        help="on SIGTERM, seconds fills in progress get to finish before they are cancelled (default 30)",
    )
    serve.set_defaults(run=_serve, default_log_level="info")  # a service logs its start and each fill
    for name, text in (("ls", "list the entries"), ("stats", "the daemon's counters")):
        action = actions.add_parser(name, allow_abbrev=False, help=text)
        _add_socket(action)
        action.set_defaults(run=_simple, op=name)
    fleet = actions.add_parser(
        "fleet", allow_abbrev=False, help="the nodes of a fleet and the entries each holds (asks etcd, not a daemon)"
    )
    fleet.add_argument("--fleet", action="append", required=True, metavar="etcd://HOST:PORT/PREFIX", help="the fleet")
    fleet.add_argument("--fleet-ca", default=None, metavar="PEM", help="etcds://: the CA to trust")
    fleet.add_argument("--fleet-cert", default=None, metavar="PEM", help="etcds://: a client certificate")
    fleet.add_argument("--fleet-key", default=None, metavar="PEM", help="etcds://: its private key")
    fleet.add_argument("--json", action="store_true", help="the answer as JSON")
    fleet.set_defaults(run=_describe_fleet)
    stop = actions.add_parser("stop", allow_abbrev=False, help="stop the daemon")
    stop.add_argument("--wait", action="store_true", help="return once the daemon has stopped (its socket gone)")
    _add_socket(stop)
    stop.set_defaults(run=_stop, op="stop")
    evict = actions.add_parser(
        "evict", allow_abbrev=False, help="remove entries no process uses: by key, by URI (a file or a directory)"
    )
    evict.add_argument(
        "entry", nargs="?", default=None, metavar="KEY|URI", help="an entry's key, or a file or directory it caches"
    )
    evict.add_argument("--all", action="store_true", help="every entry no process uses")
    _add_socket(evict)
    evict.set_defaults(run=_simple, op="evict")
    prefetch = actions.add_parser(
        "prefetch", allow_abbrev=False, help="fill the cache with a checkpoint before its engine starts"
    )
    prefetch.add_argument(
        "uri", help="the checkpoint: a path, or an s3://, gs://, az://, http(s)://, oci://, hf:// URI"
    )
    prefetch.add_argument("--format", default="auto", help="how to read it (default auto)")
    add_storage_arguments(prefetch)
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
    parser.add_argument("--json", action="store_true", help="the answer as JSON")


def _socket(args: argparse.Namespace) -> str:
    return args.socket or own_socket()


def _seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text[:40]!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"seconds must be positive and finite, got {text[:40]!r}")
    return value


MAX_ID = 2**32 - 1
"""Linux ids are 32 bits, and ``(gid_t) -1`` means "no change" to the calls that take one."""


def _group(name: str | None) -> int | None:
    """The gid ``--group`` names (a group name or a number)."""
    if name is None:
        return None
    if name.isdigit():
        if int(name) >= MAX_ID:
            raise CacheConfigError(f"--group {printable(name[:64])}: a group id is below {MAX_ID} (or name a group)")
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise CacheConfigError(f"--group {printable(name[:64])}: no such group") from None


def _serve(args: argparse.Namespace) -> int:
    return run_daemon(
        args.dir,
        _socket(args),
        args.budget,
        group=_group(args.group),
        status=args.json,
        idle_timeout_s=args.idle_timeout,
        stop_timeout_s=args.stop_timeout,
        huge_pages=args.huge_pages,
        devices=args.device,
        device_budget=args.device_budget,
        default_socket=args.socket is None and not os.environ.get(ENVIRONMENT),
        fleet=_fleet(args),
    )


def _describe_fleet(args: argparse.Namespace) -> int:
    from weightstream.nodecache.daemon.fleet.node import describe_fleet, parse_fleet, tls_context

    address = parse_fleet(args.fleet)
    described = describe_fleet(address, tls_context(args.fleet_ca, args.fleet_cert, args.fleet_key, address))
    if args.json:
        print(json.dumps(described))
        return 0
    nodes = described["nodes"]
    print(f"{len(nodes)} nodes in {described['prefix']}")  # type: ignore[arg-type]
    for node, held in sorted(nodes.items()):  # type: ignore[union-attr]
        print(f"{printable(node)}: {len(held['complete'])} entries held, {len(held['filling'])} filling")
    return 0


def _fleet(args: argparse.Namespace) -> Callable[[], FleetNode] | None:
    """How this daemon joins the fleet ``--fleet`` names (after its own checks, before it listens)."""
    if not args.fleet:
        if args.fleet_node or args.fleet_ca or args.fleet_cert or args.fleet_key or args.fleet_transfer_timeout:
            raise CacheConfigError(
                "--fleet-node, --fleet-ca, --fleet-cert, --fleet-key and --fleet-transfer-timeout need --fleet"
            )
        return None
    import socket

    from weightstream.nodecache.daemon.fleet.node import FleetNode, check_node_name, parse_fleet, tls_context
    from weightstream.nodecache.daemon.fleet.transfer import PIECE_TIMEOUT_S

    address = parse_fleet(args.fleet)
    context = tls_context(args.fleet_ca, args.fleet_cert, args.fleet_key, address)
    node = args.fleet_node or socket.gethostname()
    check_node_name(node)
    home = hashlib.sha256(f"{socket.gethostname()}\0{os.path.realpath(args.dir)}".encode()).hexdigest()[:32]
    timeout = args.fleet_transfer_timeout or PIECE_TIMEOUT_S
    return lambda: FleetNode.join(address, node, context, home, lambda: not in_use(args.dir), timeout)


def _cache(args: argparse.Namespace) -> NodeCache:
    import weightstream  # the API: not for `--help`

    return weightstream.NodeCache(args.socket or "auto")


def _simple(args: argparse.Namespace) -> int:
    cache = _cache(args)
    if args.op == "evict":
        if args.entry is None and not args.all:
            raise CacheError("evict: name a KEY or a URI, or pass --all for every entry no process uses")
        answer = cache.evict(args.entry, all=args.all and args.entry is None)
    else:
        answer = cache.stats() if args.op == "stats" else {"entries": cache.ls()}
    if args.json:
        print(json.dumps(answer))
    elif args.op == "ls":
        print(_table(answer["entries"]))  # type: ignore[arg-type]
    elif args.op == "evict":
        evicted, kept = answer["evicted"], answer["kept_referenced"]
        print(f"evicted {len(evicted)} entries" + (f"; kept {len(kept)} in use" if kept else ""))  # type: ignore[arg-type]
    else:
        print("\n".join(_stats_lines(answer)))
    return 0


ABSENT = {
    "budget": "as much as fits",
    "fleet": "not in a fleet",
    "etcd_error": "none (its lease renews)",
    "out_of_fleet": "no",
}
"""What ``stats`` means by ``null`` for the fields where it has a meaning."""


def _stats_lines(answer: dict[str, object], prefix: str = "") -> list[str]:
    """``stats`` for people: sizes in GiB as ``ls`` gives them, ``yes``/``no``, words for absent values, nested counts
    as ``fleet.bytes_from_peers``; the per-entry counts only by number (``--json`` has them).

    Example:
        >>> _stats_lines({"ok": True, "budget": None, "bytes": 3 << 29, "huge_pages": False, "fleet": {"entries": {}}})
        ['budget: as much as fits', 'bytes: 1.500 GiB', 'huge_pages: no', 'fleet.entries: 0']
    """
    lines = []
    for key, value in answer.items():
        name = prefix + key
        if key == "ok":
            continue
        if isinstance(value, dict):
            lines += (
                [f"{name}: {len(value)}"] if key == "entries" else _stats_lines(value, name + ".") or [f"{name}: -"]
            )
        elif value is None:
            lines.append(f"{name}: {ABSENT.get(key, '-')}")
        elif isinstance(value, bool):
            lines.append(f"{name}: {'yes' if value else 'no'}")
        elif isinstance(value, int) and (key.startswith("bytes") or key.endswith("bytes") or key == "budget"):
            lines.append(f"{name}: {value / 2**30:.3f} GiB")
        else:
            lines.append(f"{name}: {printable(str(value))}")
    return lines


def _table(entries: list[dict[str, object]]) -> str:
    """``ls`` for people: a header row, sizes in GiB, URIs redacted and safe for a terminal."""
    if not entries:
        return "the cache is empty"
    rows = [("KEY", "GIB", "REFS", "URI")]
    rows += [
        (
            str(entry["key"]),
            f"{int(entry['size']) / 2**30:.3f}",  # type: ignore[call-overload]
            str(len(entry["references"])),  # type: ignore[arg-type]
            printable(redact(str(entry["uri"]))),
        )
        for entry in entries
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    return "\n".join(f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}  {row[3]}" for row in rows)


def _stop(args: argparse.Namespace) -> int:
    """``cache stop [--wait]``."""
    answer = _cache(args).stop(wait=args.wait)
    print(json.dumps(answer) if args.json else ("stopped" if args.wait else "stopping"))
    return 0


def _prefetch(args: argparse.Namespace) -> int:
    bar = ProgressBar(label="prefetch") if sys.stderr.isatty() and not args.json else None

    def advance(nbytes: int, total: int) -> None:
        bar.total = total  # type: ignore[union-attr]
        bar.advance(nbytes)  # type: ignore[union-attr]

    options = storage_options(args.storage_option, args.storage_options_file)
    with contextlib.nullcontext() if bar is None else bar.expecting(0):
        result = _cache(args).prefetch(
            args.uri,
            args.format,
            device=args.device,
            storage_options=options or None,
            progress=None if bar is None else advance,
        )
    said = f"cached {result['files']} files, {int(result['bytes']) / 2**30:.3f} GiB of {printable(str(result['uri']))}"
    print(json.dumps(result) if args.json else said)
    return 0


def run_daemon(
    directory: str,
    socket_path: str,
    budget: int | None,
    *,
    group: int | None = None,
    status: bool = False,
    idle_timeout_s: float = 10.0,
    stop_timeout_s: float = 30.0,
    huge_pages: str = "auto",
    devices: list[str] | None = None,
    device_budget: int | None = None,
    default_socket: bool = False,
    fleet: Callable[[], FleetNode] | None = None,
) -> int:
    """``weightstream cache serve``: run in the foreground until SIGTERM; 0 on a clean stop. With
    ``default_socket``, the socket's directory (``/run/weightstream``, ``/tmp/weightstream-<uid>``) is made if
    missing, and must be this user's.

    Raises:
        CacheConfigError, CacheInUseError: an option, the directory or the socket refused, before anything starts.
    """
    from weightstream.nodecache.daemon.server import CacheDaemon  # the segments' machinery: not for `--help`

    if device_budget is not None and not devices:
        raise CacheConfigError("--device-budget without --device: the daemon keeps no device copies to bound")
    if default_socket:
        socket_directory(os.path.dirname(socket_path), group)
    if budget is not None:
        budget = clamp_budget(budget, directory)
    member = None if fleet is None else fleet()
    try:
        daemon = CacheDaemon(
            directory,
            socket_path,
            budget,
            group=group,
            idle_timeout_s=idle_timeout_s,
            stop_timeout_s=stop_timeout_s,
            huge_pages=huge_pages,
            devices=devices,
            device_budget=device_budget,
            fleet=member,
        )
    except BaseException:
        if member is not None:
            member.close()
        raise
    daemon.install_signal_handlers()
    daemon.serve(on_ready=(lambda: print(json.dumps(daemon.status()), flush=True)) if status else None)
    return 0
