"""The ``weightstream`` command: a thin shell over the Python API.

weightstream inspect URI [--json]
weightstream load URI [--json] [--format F] [--device cuda] [--pin-memory] [--threads N] [--chunk-mib M]
                      [--prefetch-layers N] [--filter NAME ...]
weightstream bench [URI] [--device cuda] [--size 1GiB] [--layers N] [--rounds 3] [--json] [--plot bench.png]
weightstream convert SRC DST --to sharded-state --tp N [--engine vllm|sglang] [--rule PATTERN=DIM ...]
                             [--max-file-mib M] [--json]
weightstream push DIR oci://registry/repository:tag [--json]
weightstream cache serve [--dir DIR] [--socket PATH] [--budget SIZE] [--group G] [--device cuda:N ...]
                         [--idle-timeout S] [--stop-timeout S] [--json]
weightstream cache ls|stats|stop [--wait]|evict KEY|URI|--all|prefetch URI [--device cuda:N] [--socket PATH] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence

import weightstream
from weightstream.arguments import parse_rank, parse_size, positive
from weightstream.errors import WeightstreamError
from weightstream.nodecache.daemon.commands import add_cache_commands
from weightstream.progress import ProgressBar
from weightstream.terminal import printable

DEMO_BYTES = 1 << 30
BENCH_DEVICES = ("cpu", "cuda")
BENCH_CACHES = ("cold", "warm")

LOG_ENVIRONMENT = "WEIGHTSTREAM_LOG"
"""The log level of the command (``debug``, ``info``, ``warning``, ``error``) when ``--log-level`` is not given."""
LOG_LEVELS = ("debug", "info", "warning", "error")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 success, 1 a weightstream error, 2 usage, 130 interrupted)."""
    args = _parser().parse_args(argv)
    _log_to_stderr(args.log_level or os.environ.get(LOG_ENVIRONMENT) or "warning")
    try:
        return args.run(args)
    except WeightstreamError as error:
        print(f"weightstream: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("weightstream: interrupted", file=sys.stderr)
        return 130


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


def _rank_options(args: argparse.Namespace) -> dict[str, object]:
    """``--rank`` and ``--world-size`` as the sharded-state loader's options (other loaders refuse them)."""
    return {name: value for name, value in (("rank", args.rank), ("world_size", args.world_size)) if value is not None}


def _inspect(args: argparse.Namespace) -> int:
    from weightstream.formats.safetensors import DTYPE_NAMES

    with weightstream.open(args.uri, args.format, **_rank_options(args)) as checkpoint:
        plan = checkpoint.plan
    if args.json:
        print(
            json.dumps(
                {
                    "uri": args.uri,
                    "total_bytes": plan.total_bytes,
                    "files": [
                        {"path": f.path, "size": f.size, "data_offset": f.data_offset, "metadata": dict(f.metadata)}
                        for f in plan.files
                    ],
                    "tensors": [
                        {
                            "name": t.name,
                            "dtype": DTYPE_NAMES[t.dtype],
                            "shape": list(t.shape),
                            "nbytes": t.nbytes,
                            "file": t.file,
                            "offset": t.offset,
                        }
                        for t in plan.tensors
                    ],
                },
                indent=2,
            )
        )
        return 0
    for spec in plan.files:
        count = sum(1 for t in plan.tensors if t.file == spec.path)
        metadata = ", ".join(f"{printable(key)}: {printable(value)}" for key, value in spec.metadata.items())
        print(f"{printable(spec.path)}: {spec.size} bytes, {count} tensors, metadata {{{metadata}}}")
    names = [printable(t.name) for t in plan.tensors]
    width = max((len(name) for name in names), default=4)
    print(f"{'name':{width}s}  {'dtype':11s} {'shape':22s} {'bytes':>12s}")
    for name, t in zip(names, plan.tensors, strict=True):
        print(f"{name:{width}s}  {DTYPE_NAMES[t.dtype]:11s} {list(t.shape)!s:22s} {t.nbytes:12d}")
    print(f"{len(plan.tensors)} tensors, {plan.total_bytes} bytes ({plan.total_bytes / 2**30:.3f} GiB)")
    return 0


def _load(args: argparse.Namespace) -> int:
    options = {"threads": args.threads, "device": args.device, "pin_memory": args.pin_memory, **_rank_options(args)}
    if args.no_huge_pages:
        options["huge_pages"] = False
    if args.chunk_mib is not None:
        options["chunk_bytes"] = args.chunk_mib << 20
    if args.max_inflight_mib is not None:
        options["max_inflight_bytes"] = args.max_inflight_mib << 20
    if args.prefetch_layers is not None:
        options["prefetch_layers"] = args.prefetch_layers
    if args.filter:
        options["filter"] = args.filter
    if args.cache is not None:
        options["cache"] = args.cache
    bar = ProgressBar(label="load") if sys.stderr.isatty() and not args.json else None
    if bar is not None:
        options["progress"] = bar.advance
    start = time.perf_counter()
    count, nbytes, first = 0, 0, None
    checkpoint = weightstream.open(args.uri, args.format, **options)
    with checkpoint, contextlib.nullcontext() if bar is None else bar.expecting(checkpoint.plan.total_bytes):
        for _, tensor in checkpoint.iter_weights():
            first = first if first is not None else time.perf_counter() - start
            count, nbytes = count + 1, nbytes + tensor.numel() * tensor.element_size()
    seconds = time.perf_counter() - start
    loader = checkpoint.format
    result = {
        "uri": args.uri,
        "format": loader,
        "device": checkpoint.options.device,
        "tensors": count,
        "bytes": nbytes,
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9,
        "first_tensor_seconds": first,
    }
    return _report(
        args.json,
        result,
        f"loaded {count} tensors, {nbytes / 2**30:.3f} GiB in {seconds:.3f} s: {result['gbps']:.2f} GB/s "
        f"(first tensor after {1000 * (first or 0):.0f} ms) with the {loader} loader",
    )


def _report(as_json: bool, result: dict, text: str) -> int:
    """Print ``result`` as one JSON line (``--json``) or ``text`` for people; the command's exit status."""
    print(json.dumps(result) if as_json else text)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from weightstream.bench.demo import demo_checkpoint
    from weightstream.bench.runner import check_device, format_table, plot, run_bench

    check_device(args.device)
    uri = args.uri
    if uri is None:
        print(
            f"building (or reusing) a demo Llama checkpoint of about {args.size / 2**30:.2f} GiB ...", file=sys.stderr
        )
        uri = demo_checkpoint(args.size, shards=args.shards, cache_dir=args.cache_dir, layers=args.layers)
    methods = args.methods.split(",") if args.methods else None
    caches = args.cache.split(",")
    report = run_bench(
        uri,
        methods=methods,
        caches=caches,
        rounds=args.rounds,
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


def _push(args: argparse.Namespace) -> int:
    from weightstream.save.push import push

    files = [os.path.join(root, name) for root, _, names in os.walk(args.directory) for name in names]
    bar = ProgressBar(label="push") if sys.stderr.isatty() and not args.json else None
    start = time.perf_counter()
    with contextlib.nullcontext() if bar is None else bar.expecting(sum(os.path.getsize(f) for f in files)):
        result = push(args.directory, args.uri, progress=None if bar is None else bar.advance)
    result["seconds"] = time.perf_counter() - start
    return _report(
        args.json,
        result,
        f"pushed {result['files']} files ({result['bytes_sent']} of {result['bytes']} bytes sent) to {args.uri}: "
        f"{result['digest']}",
    )


def _convert(args: argparse.Namespace) -> int:
    from weightstream.errors import InvalidOptionError
    from weightstream.save.convert import LLAMA_RULES, convert_to_sharded_state, parse_rule, split_dimension

    if args.to != "sharded-state":
        raise InvalidOptionError(f"--to {args.to!r}: the one conversion is to sharded-state")
    rules = [parse_rule(text) for text in args.rule or []] + list(LLAMA_RULES)
    with weightstream.open(args.src) as checkpoint:
        plan = checkpoint.plan
    bar = ProgressBar(label="convert") if sys.stderr.isatty() and not args.json else None
    start = time.perf_counter()
    # What the ranks write together: a split tensor once in all, a replicated one once per rank.
    total = sum(
        spec.nbytes * (1 if split_dimension(spec.name, spec.shape, args.tp, rules) is not None else args.tp)
        for spec in plan.tensors
    )
    with contextlib.nullcontext() if bar is None else bar.expecting(total):
        result = convert_to_sharded_state(
            args.src,
            args.dst,
            tp=args.tp,
            rules=rules,
            max_file_bytes=args.max_file_mib << 20,
            progress=None if bar is None else bar.advance,
            engine=args.engine,
        )
    seconds = time.perf_counter() - start
    replicated = sorted(name for name, dimension in result["split"].items() if dimension is None)
    summary = {
        "src": args.src,
        "dst": args.dst,
        "tp": args.tp,
        "engine": args.engine,
        "files": result["files"],
        "seconds": seconds,
        "replicated": replicated,
        "copied": result["copied"],
    }
    return _report(
        args.json,
        summary,
        f"wrote {len(result['files'])} files for {args.tp} ranks into {args.dst} in {seconds:.2f} s "
        f"({len(result['split']) - len(replicated)} tensors split, {len(replicated)} replicated; "
        f"{len(result['copied'])} files copied beside them: {', '.join(result['copied']) or 'none'})",
    )


def _add_rank_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--rank", type=parse_rank, default=None, help="--format sharded-state: whose files (N, or PP,TP)"
    )
    command.add_argument(
        "--world-size",
        type=parse_rank,
        default=None,
        help="--format sharded-state: the world size, checked against the manifest (N, or PP,TP)",
    )


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
        help=f"log lines shown on stderr (default: ${LOG_ENVIRONMENT}, else warning)",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    inspect = commands.add_parser(
        "inspect", allow_abbrev=False, help="list tensors, dtypes, shapes, bytes and metadata (reads headers only)"
    )
    inspect.add_argument("uri")
    inspect.add_argument("--format", default="auto")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    _add_rank_arguments(inspect)
    inspect.set_defaults(run=_inspect)

    load = commands.add_parser("load", allow_abbrev=False, help="load every tensor and report GB/s")
    load.add_argument("uri")
    load.add_argument("--format", default="auto")
    load.add_argument("--threads", type=int, default=None)
    load.add_argument(
        "--chunk-mib", type=int, default=None, help="largest read request in MiB (default 8 local, 64 remote)"
    )
    load.add_argument(
        "--max-inflight-mib", type=int, default=None, help="streaming loader: memory window in MiB (default 1024)"
    )
    load.add_argument("--prefetch-layers", type=int, default=None, help="layered loader: layers read ahead (default 1)")
    load.add_argument("--no-huge-pages", action="store_true", help="do not ask for transparent huge pages")
    load.add_argument("--filter", nargs="+", metavar="NAME", help="load only these tensors")
    load.add_argument("--device", default="cpu", help="where tensors land: cpu (default), cuda, cuda:N")
    load.add_argument("--pin-memory", action="store_true", help="pinned CPU tensors (needs CUDA and cuda-python)")
    load.add_argument("--cache", default=None, help="read through the node cache: its socket, or 'auto'")
    load.add_argument("--json", action="store_true")
    _add_rank_arguments(load)
    load.set_defaults(run=_load)

    bench = commands.add_parser(
        "bench", allow_abbrev=False, help="compare weightstream with its peers and the machine's limits"
    )
    bench.add_argument(
        "uri",
        nargs="?",
        help="a checkpoint (a path, s3://, gs://, http(s)://); default: a demo Llama checkpoint built in the cache",
    )
    bench.add_argument("--size", type=parse_size, default=DEMO_BYTES, help="demo checkpoint size (default 1GiB)")
    bench.add_argument("--shards", type=int, default=2, help="demo checkpoint shards (default 2)")
    bench.add_argument(
        "--layers",
        type=int,
        default=None,
        help="demo checkpoint layers, made as wide as --size needs (default: 2048 wide)",
    )
    bench.add_argument("--cache-dir", default=None, help="where demo checkpoints live (default ~/.cache/weightstream)")
    bench.add_argument("--rounds", type=int, default=3)
    bench.add_argument("--device", choices=BENCH_DEVICES, default="cpu", help="where tensors land (default cpu)")
    bench.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods (default: every one installed for the device; an unknown name lists them)",
    )
    bench.add_argument(
        "--cache", default=",".join(BENCH_CACHES), help=f"page-cache states, comma-separated: {', '.join(BENCH_CACHES)}"
    )
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--plot", metavar="PNG", default=None, help="also write a bar chart")
    bench.set_defaults(run=_bench)

    convert = commands.add_parser(
        "convert", allow_abbrev=False, help="convert a Hugging Face checkpoint into a tensor-parallel sharded state"
    )
    convert.add_argument("src")
    convert.add_argument("dst")
    convert.add_argument("--to", required=True, help="the target format: sharded-state")
    convert.add_argument("--tp", type=positive, required=True, help="tensor-parallel ranks (1 or more)")
    convert.add_argument(
        "--rule",
        action="append",
        metavar="PATTERN=DIM",
        help="a split rule tried before the Llama ones (DIM or 'replicate'); repeatable",
    )
    convert.add_argument("--max-file-mib", type=int, default=5 << 10, help="largest part file in MiB (default 5120)")
    convert.add_argument(
        "--engine",
        choices=("vllm", "sglang"),
        default=None,
        help="save in the engine's naming (fused qkv_proj/gate_up_proj, padded vocabulary), for its --load-format "
        "sharded_state or weightstream-sharded-state; default: the checkpoint's names",
    )
    convert.add_argument("--json", action="store_true")
    convert.set_defaults(run=_convert)
    pushing = commands.add_parser(
        "push", allow_abbrev=False, help="upload a checkpoint directory to an OCI registry as a ModelPack artifact"
    )
    pushing.add_argument("directory")
    pushing.add_argument("uri", help="oci://registry[:port]/repository:tag (credentials: docker login)")
    pushing.add_argument("--json", action="store_true")
    pushing.set_defaults(run=_push)
    add_cache_commands(commands, parse_size)
    return parser


if __name__ == "__main__":
    sys.exit(main())
