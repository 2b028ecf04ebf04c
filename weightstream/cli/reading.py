"""``weightstream inspect`` and ``weightstream load``, and the arguments every reading command shares: the format,
storage options, ranks, tensor filters."""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import sys
import time
from typing import TYPE_CHECKING

import weightstream
from weightstream.arguments import add_storage_arguments, parse_rank, positive, storage_options
from weightstream.errors import InvalidOptionError
from weightstream.progress import ProgressBar
from weightstream.terminal import printable

if TYPE_CHECKING:  # --help imports no torch
    from weightstream.formats.sharded_state import Rank
    from weightstream.planning.plan import LoadPlan

GLOB_CHARACTERS = "*?["
BUILT_IN_FORMATS = ("safetensors", "streaming", "layered", "sharded-state", "distributed")
"""The registry's built-in names, for ``--help`` (which imports no registry: it imports torch)."""


def add_reading_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``inspect`` and ``load``."""
    inspect = commands.add_parser(
        "inspect", allow_abbrev=False, help="list tensors, dtypes, shapes, bytes and metadata (reads headers only)"
    )
    add_source_arguments(inspect)
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    _add_rank_arguments(inspect)
    inspect.set_defaults(run=_inspect)

    load = commands.add_parser("load", allow_abbrev=False, help="load every tensor and report GB/s")
    add_source_arguments(load)
    load.add_argument("--threads", type=positive, default=None, help="reading threads (default: chosen per source)")
    load.add_argument(
        "--chunk-mib", type=positive, default=None, help="largest read request in MiB (default 8 local, 64 remote)"
    )
    load.add_argument(
        "--max-inflight-mib",
        type=positive,
        default=None,
        help="--format streaming: memory window in MiB (default 1024)",
    )
    load.add_argument(
        "--prefetch-layers", type=positive, default=None, help="--format layered: layers read ahead (default 1)"
    )
    load.add_argument("--no-huge-pages", action="store_true", help="do not ask for transparent huge pages")
    load.add_argument(
        "--filter",
        nargs="+",
        metavar="NAME",
        help="load only these tensors: names, or shell patterns ('model.layers.0.*'); each must select one or more",
    )
    load.add_argument("--device", default="cpu", help="where tensors land: cpu (default), cuda, cuda:N")
    load.add_argument(
        "--pin-memory",
        nargs="?",
        const=True,
        default=False,
        type=_auto,
        metavar="auto",
        help="page-locked CPU tensors (needs CUDA and cuda-python); 'auto': only where CUDA is present",
    )
    load.add_argument(
        "--cache", default=None, metavar="SOCKET|auto", help="read through the node cache daemon at this socket"
    )
    load.add_argument("--json", action="store_true", help="one JSON line of results")
    _add_rank_arguments(load)
    load.set_defaults(run=_load)


def add_source_arguments(command: argparse.ArgumentParser) -> None:
    """A checkpoint's URI, its format and storage options."""
    command.add_argument(
        "uri", help="a path, s3://, gs://, az://, http(s)://, oci:// or hf:// URI, or a directory of them"
    )
    command.add_argument(
        "--format",
        default="auto",
        help=f"how to read it: auto (default), {', '.join(BUILT_IN_FORMATS)}, or a plugin's name",
    )
    add_storage_arguments(command)


def source_options(args: argparse.Namespace) -> dict[str, object]:
    """The options of ``weightstream.open`` that the source arguments set."""
    found = storage_options(args.storage_option, args.storage_options_file)
    return {"storage_options": found} if found else {}


def _auto(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"--pin-memory takes no value or 'auto', got {text[:40]!r}")
    return text


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


def _rank_options(args: argparse.Namespace) -> dict[str, object]:
    """``--rank`` and ``--world-size`` as the sharded-state loader's options (other loaders refuse them)."""
    return {name: value for name, value in (("rank", args.rank), ("world_size", args.world_size)) if value is not None}


class TensorFilter:
    """The tensors ``--filter`` selects: a name is itself, a shell pattern every name it matches. It remembers which
    patterns selected a name it was asked about (the planner asks about every tensor of the checkpoint).

    Example:
        >>> wanted = TensorFilter(["lm_head.weight", "model.layers.0.*", "nope"])
        >>> wanted("model.layers.0.mlp.up_proj.weight"), wanted("model.layers.1.mlp.up_proj.weight")
        (True, False)
        >>> wanted.unmatched()
        ['lm_head.weight', 'nope']
    """

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = patterns
        self._seen: set[str] = set()
        self._matched: set[str] = set()

    def __call__(self, name: str) -> bool:
        self._seen.add(name)
        selected = {pattern for pattern in self.patterns if _selects(pattern, name)}
        self._matched |= selected
        return bool(selected)

    def unmatched(self) -> list[str]:
        """The patterns that selected none of the names asked about."""
        return [pattern for pattern in self.patterns if pattern not in self._matched]

    def check(self, uri: str) -> None:
        """Refuse a pattern that selected no tensor of the checkpoint (called once it is planned, before reads)."""
        if self.unmatched():
            patterns = " ".join(printable(repr(pattern)) for pattern in self.unmatched())
            raise InvalidOptionError(f"{uri}: --filter {patterns} selects none of its {len(self._seen)} tensors")


def _selects(pattern: str, name: str) -> bool:
    if any(character in pattern for character in GLOB_CHARACTERS):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern


def _inspect(args: argparse.Namespace) -> int:
    ranks = _ranks_to_describe(args)
    if not ranks:
        with weightstream.open(args.uri, args.format, **source_options(args), **_rank_options(args)) as checkpoint:
            plans: list[tuple[Rank | None, LoadPlan]] = [(None, checkpoint.plan)]
    else:  # a sharded state of several ranks, no --rank: every rank's files
        plans = []
        for rank in ranks:
            with weightstream.open(args.uri, "sharded-state", rank=rank, **source_options(args)) as checkpoint:
                plans.append((rank, checkpoint.plan))
    total = sum(plan.total_bytes for _, plan in plans)
    if args.json:
        described = [_plan_json(plan) for _, plan in plans]
        if ranks:
            each = [
                {"rank": list(rank) if isinstance(rank, tuple) else rank, **one}
                for rank, one in zip(ranks, described, strict=True)
            ]
            document = {"uri": args.uri, "total_bytes": total, "ranks": each}
        else:
            document = {"uri": args.uri, **described[0]}
        print(json.dumps(document, indent=2))
        return 0
    for whose, plan in plans:
        if whose is not None:
            print(f"rank {'.'.join(map(str, whose)) if isinstance(whose, tuple) else whose}:")
        _print_plan(plan)
    if ranks:
        tensors = sum(len(plan.tensors) for _, plan in plans)
        print(f"{len(ranks)} ranks, {tensors} tensors, {total} bytes ({total / 2**30:.3f} GiB)")
    return 0


def _ranks_to_describe(args: argparse.Namespace) -> list[Rank]:
    """The ranks of a sharded-state directory of more than one rank, where no ``--rank`` picks one; else []."""
    if args.rank is not None or args.world_size is not None or args.format not in ("auto", "sharded-state"):
        return []
    from weightstream.loaders.sharded_state import saved_ranks
    from weightstream.sources import store_for

    with contextlib.closing(
        store_for(args.uri, storage_options(args.storage_option, args.storage_options_file))
    ) as store:
        ranks = saved_ranks(store, args.uri)
    return ranks if len(ranks) > 1 else []


def _plan_json(plan: LoadPlan) -> dict[str, object]:
    from weightstream.formats.safetensors import DTYPE_NAMES

    files = [
        {"path": f.path, "size": f.size, "data_offset": f.data_offset, "metadata": dict(f.metadata)} for f in plan.files
    ]
    tensors = [
        {
            "name": t.name,
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "nbytes": t.nbytes,
            "file": t.file,
            "offset": t.offset,
        }
        for t in plan.tensors
    ]
    return {"total_bytes": plan.total_bytes, "files": files, "tensors": tensors}


def _print_plan(plan: LoadPlan) -> None:
    from weightstream.formats.safetensors import DTYPE_NAMES

    for spec in plan.files:
        count = sum(1 for t in plan.tensors if t.file == spec.path)
        metadata = ", ".join(f"{printable(key)}: {printable(value)}" for key, value in spec.metadata.items())
        print(f"{printable(spec.path)}: {spec.size} bytes, {count} tensors, metadata {{{metadata}}}")
    names = [printable(t.name) for t in plan.tensors]
    width = max((len(name) for name in names), default=4)
    print(f"{'name':{width}s}  {'dtype':11s} {'shape':22s} {'bytes':>12s}")
    for name, t in zip(names, plan.tensors, strict=True):
        print(f"{name:{width}s}  {DTYPE_NAMES[t.dtype]:11s} {list(t.shape)!s:22s} {t.nbytes:12d}")
    total = plan.total_bytes
    print(f"{len(plan.tensors)} tensors, {total} bytes ({total / 2**30:.3f} GiB)")


def _load_options(args: argparse.Namespace) -> dict[str, object]:
    options: dict[str, object] = {
        "threads": args.threads,
        "device": args.device,
        "pin_memory": args.pin_memory,
        **source_options(args),
        **_rank_options(args),
    }
    given = {
        "huge_pages": False if args.no_huge_pages else None,
        "chunk_bytes": None if args.chunk_mib is None else args.chunk_mib << 20,
        "max_inflight_bytes": None if args.max_inflight_mib is None else args.max_inflight_mib << 20,
        "prefetch_layers": args.prefetch_layers,
        "cache": args.cache,
    }
    options.update({name: value for name, value in given.items() if value is not None})
    return options


def _load(args: argparse.Namespace) -> int:
    options = _load_options(args)
    selected = TensorFilter(args.filter) if args.filter else None
    if selected is not None:
        options["filter"] = selected
    bar = ProgressBar(label="load") if sys.stderr.isatty() and not args.json else None
    if bar is not None:
        options["progress"] = bar.advance
    start = time.perf_counter()
    count, nbytes, first = 0, 0, None
    checkpoint = weightstream.open(args.uri, args.format, **options)
    with checkpoint, contextlib.nullcontext() if bar is None else bar.expecting(checkpoint.plan.total_bytes):
        if selected is not None:
            selected.check(args.uri)
        for _, tensor in checkpoint.iter_weights():
            first = first if first is not None else time.perf_counter() - start
            count, nbytes = count + 1, nbytes + tensor.numel() * tensor.element_size()
    seconds = time.perf_counter() - start
    result = {
        "uri": args.uri,
        "format": checkpoint.format,
        "device": checkpoint.options.device,
        "tensors": count,
        "bytes": nbytes,
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9,
        "first_tensor_seconds": first,
    }
    cache = checkpoint.stats.cache
    if cache:
        result["cache"] = cache
    return report(
        args.json,
        result,
        f"loaded {count} tensors, {nbytes / 2**30:.3f} GiB in {seconds:.3f} s: {result['gbps']:.2f} GB/s "
        f"(first tensor after {1000 * (first or 0):.0f} ms) with the {checkpoint.format} loader" + _cache_said(cache),
    )


def _cache_said(cache: dict[str, object]) -> str:
    """The node cache's part in a load, for its summary line ("" where no ``--cache`` was given)."""
    if not cache:
        return ""
    if not cache["used"]:
        return f"; the node cache was not used: {cache['why']}"
    return f"; through the node cache: {cache['hit']} files found there, {cache['filled']} filled"


def report(as_json: bool, result: dict, text: str) -> int:
    """Print ``result`` as one JSON line (``--json``) or ``text`` for people; the command's exit status."""
    print(json.dumps(result) if as_json else text)
    return 0
