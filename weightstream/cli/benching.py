"""``weightstream bench``: weightstream beside its peers and the machine's limits, on a checkpoint or a demo."""

from __future__ import annotations

import argparse
import json
import sys

from weightstream.arguments import parse_size, positive

DEMO_BYTES = 1 << 30
QUICK_BYTES = 256 << 20
SECONDS_PER_RUN = 2.0
"""A fresh process's start (torch's import), page-cache preparation and its end, beside the bytes: the estimate's."""
ESTIMATED_GBPS = 1.0
"""The rate the estimate assumes for a run's bytes (cold and warm, all methods: rough by design)."""
BENCH_DEVICES = ("cpu", "cuda")
BENCH_CACHES = ("cold", "warm")


def add_bench_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``bench``."""
    bench = commands.add_parser(
        "bench", allow_abbrev=False, help="compare weightstream with its peers and the machine's limits"
    )
    bench.add_argument(
        "uri",
        nargs="?",
        help="a checkpoint (a path, s3://, gs://, http(s)://); default: a demo Llama checkpoint built in the cache",
    )
    bench.add_argument(
        "--size",
        type=parse_size,
        default=DEMO_BYTES,
        help="demo checkpoint size (default 1GiB; from about 1MiB up, within 25%%, else refused)",
    )
    bench.add_argument("--shards", type=positive, default=2, help="demo checkpoint shards (default 2)")
    bench.add_argument(
        "--layers",
        type=positive,
        default=None,
        help="demo checkpoint layers, made as wide as --size needs (default: 2048 wide)",
    )
    bench.add_argument("--cache-dir", default=None, help="where demo checkpoints live (default ~/.cache/weightstream)")
    bench.add_argument("--rounds", type=positive, default=3, help="interleaved rounds per method (default 3)")
    bench.add_argument("--device", choices=BENCH_DEVICES, default="cpu", help="where tensors land (default cpu)")
    bench.add_argument(
        "--methods",
        default=None,
        help=(
            "comma-separated methods (default: every one installed for the device, but the peers' other settings "
            "and the sharded-state readers; an unknown name lists them all)"
        ),
    )
    bench.add_argument(
        "--page-cache",
        default=",".join(BENCH_CACHES),
        help=f"page-cache states to measure, comma-separated: {', '.join(BENCH_CACHES)} (default both)",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help=f"a first look: a {QUICK_BYTES >> 20} MiB demo checkpoint, one round (about a minute; figures of one "
        "round are rough)",
    )
    bench.add_argument("--json", action="store_true", help="the whole report as JSON")
    bench.add_argument("--plot", metavar="PNG", default=None, help="also write a bar chart (linear axis)")
    bench.set_defaults(run=_bench)


def _bench(args: argparse.Namespace) -> int:
    from weightstream.bench.demo import demo_checkpoint
    from weightstream.bench.runner import check_device, find_files_of, format_table, planned_runs, plot, run_bench
    from weightstream.bench.worker import file_sizes

    check_device(args.device)
    size, rounds = (QUICK_BYTES, 1) if args.quick else (args.size, args.rounds)
    uri = args.uri
    if uri is None:
        print(f"building (or reusing) a demo Llama checkpoint of about {size / 2**30:.2f} GiB ...", file=sys.stderr)
        uri = demo_checkpoint(size, shards=args.shards, cache_dir=args.cache_dir, layers=args.layers)
    methods = args.methods.split(",") if args.methods else None
    caches = args.page_cache.split(",")
    if not args.json:
        runs = planned_runs(uri, methods, caches, rounds, args.device) if set(caches) <= set(BENCH_CACHES) else 0
        nbytes = sum(file_sizes(uri, find_files_of(uri)))
        minutes = runs * (SECONDS_PER_RUN + nbytes / (ESTIMATED_GBPS * 1e9)) / 60
        print(
            f"{runs} runs ({rounds} round{'s' if rounds != 1 else ''} of each installed method, {', '.join(caches)}), "
            "each a fresh process: "
            f"about {max(1, round(minutes))} min" + ("" if args.quick else " (--quick for a first look)"),
            file=sys.stderr,
        )
    report = run_bench(
        uri,
        methods=methods,
        caches=caches,
        rounds=rounds,
        device=args.device,
        on_run=None if args.json else lambda line: print(line, file=sys.stderr),
    )
    if args.plot:
        plot(report.to_json(), args.plot)
    print(json.dumps(report.to_json(), indent=2) if args.json else format_table(report))
    ours = report.weightstream_failed()
    for row in ours:
        print(f"weightstream: error: {row.method} ({row.cache}) failed: {row.failed}", file=sys.stderr)
    return 1 if ours else 0
