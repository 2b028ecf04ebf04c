"""``weightstream convert`` and ``weightstream push``: checkpoints written, locally or to a registry."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import weightstream
from weightstream.arguments import positive
from weightstream.cli.reading import report
from weightstream.progress import ProgressBar


def add_writing_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``convert`` and ``push``."""
    convert = commands.add_parser(
        "convert", allow_abbrev=False, help="convert a Hugging Face checkpoint into a tensor-parallel sharded state"
    )
    convert.add_argument("src", help="the checkpoint to convert (a path or URI)")
    convert.add_argument("dst", help="a local directory for the sharded state (not inside src)")
    convert.add_argument("--to", required=True, choices=("sharded-state",), help="the target format: sharded-state")
    convert.add_argument("--tp", type=positive, required=True, help="tensor-parallel ranks (1 or more)")
    convert.add_argument(
        "--rule",
        action="append",
        metavar="PATTERN=DIM",
        help="a split rule tried before the Llama ones (DIM or 'replicate'); repeatable",
    )
    convert.add_argument(
        "--max-file-mib", type=positive, default=5 << 10, help="largest part file in MiB (default 5120)"
    )
    convert.add_argument(
        "--engine",
        choices=("vllm", "sglang"),
        default=None,
        help="save in the engine's naming (fused qkv_proj/gate_up_proj, padded vocabulary), for its --load-format "
        "sharded_state or weightstream-sharded-state; default: the checkpoint's names",
    )
    convert.add_argument("--json", action="store_true", help="one JSON line of results")
    convert.set_defaults(run=_convert)
    pushing = commands.add_parser(
        "push", allow_abbrev=False, help="upload a checkpoint directory to an OCI registry as a ModelPack artifact"
    )
    pushing.add_argument("directory", help="the checkpoint directory to upload")
    pushing.add_argument("uri", help="oci://registry[:port]/repository:tag (credentials: docker login)")
    pushing.add_argument("--json", action="store_true", help="one JSON line of results")
    pushing.set_defaults(run=_push)


def _push(args: argparse.Namespace) -> int:
    from weightstream.save.push import push

    files = [os.path.join(root, name) for root, _, names in os.walk(args.directory) for name in names]
    bar = ProgressBar(label="push") if sys.stderr.isatty() and not args.json else None
    start = time.perf_counter()
    with contextlib.nullcontext() if bar is None else bar.expecting(sum(os.path.getsize(f) for f in files)):
        result = push(args.directory, args.uri, progress=None if bar is None else bar.advance)
    result["seconds"] = time.perf_counter() - start
    return report(
        args.json,
        result,
        f"pushed {result['files']} files ({result['bytes_sent']} of {result['bytes']} bytes sent) to {args.uri}: "
        f"{result['digest']}",
    )


def _convert(args: argparse.Namespace) -> int:
    from weightstream.save.convert import LLAMA_RULES, convert_to_sharded_state, parse_rule, split_dimension

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
    return report(
        args.json,
        summary,
        f"wrote {len(result['files'])} files for {args.tp} ranks into {args.dst} in {seconds:.2f} s "
        f"({len(result['split']) - len(replicated)} tensors split, {len(replicated)} replicated; "
        f"{len(result['copied'])} files copied beside them: {', '.join(result['copied']) or 'none'})",
    )
