"""The ``sharded-state`` loader: one rank's files of a pre-sharded checkpoint, and nothing else."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from collections.abc import Iterator
from typing import ClassVar

import torch

from weightstream.errors import (
    IncompleteSaveError,
    IntegrityError,
    InvalidOptionError,
    ManifestError,
    NotFound,
    OptionError,
    SourceChangedError,
)
from weightstream.formats.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    manifest_name,
    new_hasher,
    parse_manifest,
    saving_marker_name,
)
from weightstream.formats.sharded_state import (
    DEFAULT_PATTERN,
    PP_PATTERN,
    Rank,
    ShardPattern,
    check_in_world,
    describe,
    in_world,
    is_rank,
)
from weightstream.options import LoadOptions
from weightstream.planning.discover import CheckpointFiles, read_small_file
from weightstream.planning.plan import LoadPlan
from weightstream.planning.planner import read_plan
from weightstream.readers.destination import ALL_ROUTES, Destination, choose_destination
from weightstream.readers.parallel import read_tensors
from weightstream.sources import Store


@dataclasses.dataclass(frozen=True)
class ShardedStateOptions:
    """The ``sharded-state`` loader's own options."""

    rank: Rank | None = None
    """Whose files to read: an ``int``, or ``(pp_rank, tp_rank)`` for the pipeline-parallel pattern.
    Default ``None``: ``torch.distributed``'s rank if it is initialised, else a world of one."""

    world_size: Rank | None = None
    """The world size the caller runs with, checked against the manifest (``(pp_size, tp_size)`` with
    pipeline parallelism). Default ``None``: ``torch.distributed``'s, or the manifest's."""

    shard_pattern: str | None = None
    """The file-name pattern of a directory without a manifest. Default ``None``: vLLM's
    ``model-rank-{rank}-part-{part}.safetensors`` (or the ``pp``/``tp`` one for a pair rank)."""

    verify: bool = False
    """Check every byte read against the manifest's checksums (xxh3-128). Default ``False``."""

    def __post_init__(self) -> None:
        if not isinstance(self.verify, bool):
            raise OptionError(f"verify must be a bool, got {type(self.verify).__name__}")


class ShardedStateLoader:
    """Reads the files of one rank of a directory saved by :func:`weightstream.save_sharded_state`,
    by vLLM's ``ShardedStateLoader.save_model`` or by SGLang's ``save_sharded_model``.

    The rank comes from ``rank=`` or from ``torch.distributed``. With a manifest (ours), the world
    size, the files and their tensors are checked against it before any tensor is read, and
    ``verify=True`` checks every byte against its checksums as it lands; without one (the engines'
    own saves), the files are found by ``shard_pattern``. Reads go through the core reader, so
    every destination and I/O mode of the ``safetensors`` loader works here too.
    """

    name: ClassVar[str] = "sharded-state"
    options: ClassVar[type] = ShardedStateOptions

    def check(self, opts: LoadOptions) -> None:
        if opts.own(ShardedStateOptions).verify and torch.device(opts.device).type == "cuda":
            raise InvalidOptionError(
                "verify=True checks bytes on the host: load to the CPU (or pinned memory), then move them"
            )
        _rank_of(opts)

    def plan(self, store: Store, uri: str, opts: LoadOptions) -> ShardedStatePlan:
        rank, world_size = _rank_of(opts)
        choose_destination(store, uri, opts, self.name, ALL_ROUTES)
        paths, manifest = rank_files(store, uri, rank, world_size, opts.own(ShardedStateOptions))
        plan = read_plan(store, uri, opts.wants, opts.required, CheckpointFiles(files=tuple(paths)))
        if manifest is not None:
            _check_against_manifest(store, plan, manifest, paths)
        elif opts.own(ShardedStateOptions).verify:
            raise InvalidOptionError(
                f"verify=True: {uri} has no manifest for this rank, so no checksums to verify against"
            )
        return ShardedStatePlan(plan.uri, plan.files, plan.tensors, manifest)

    def iter_weights(self, store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        if not isinstance(plan, ShardedStatePlan):
            raise InvalidOptionError(
                f"{plan.uri}: the sharded-state loader reads the plans it made (with their manifest), not a "
                f"{type(plan).__name__}"
            )
        return _read(store, plan, opts, plan.manifest, choose_destination(store, plan.uri, opts, self.name, ALL_ROUTES))


@dataclasses.dataclass(frozen=True)
class ShardedStatePlan(LoadPlan):
    """A rank's plan, with the manifest its files were checked against (``None``: an engine's own save)."""

    manifest: Manifest | None = None


def rank_files(
    store: Store, uri: str, rank: Rank | None, world_size: Rank | None, opts: ShardedStateOptions
) -> tuple[list[str], Manifest | None]:
    """The paths of ``rank``'s files in the directory ``uri``, in part order, and its manifest if it has one.
    Without a rank (none given, no ``torch.distributed``), a directory of a single rank (a world of one) is read.

    Raises:
        IncompleteSaveError: a save of the rank was interrupted (or runs now).
        ManifestError: the manifest is malformed, or the directory or the caller disagree with it.
        NotFound: no file of the rank (no manifest).
    """
    if not store.is_dir(uri):
        raise NotFound(f"{uri}: a sharded state is a directory; this is not one (or does not exist)")
    if not store.lists:
        raise InvalidOptionError(f"{uri}: the sharded-state loader lists its directory, which this store cannot")
    names = set(store.list_names(uri))
    if rank is None:
        rank = _only_rank(store, uri, names, opts)
    if saving_marker_name(rank) in names:
        raise IncompleteSaveError(
            f"{uri}: a save of {describe(rank)} did not finish (or is running): {saving_marker_name(rank)} is there; "
            f"its files are no state to load, save it again"
        )
    if manifest_name(rank) in names:
        manifest = _read_manifest(store, store.join(uri, manifest_name(rank)))
        return _files_of_manifest(store, uri, names, manifest, rank, world_size, opts), manifest
    pattern = ShardPattern(opts.shard_pattern or (PP_PATTERN if isinstance(rank, tuple) else DEFAULT_PATTERN))
    pattern.check_rank(rank)
    parts = {}
    for name in sorted(names):
        parsed = pattern.parse(name)
        if parsed is None:
            continue
        if world_size is not None and not in_world(parsed[0], world_size):
            raise ManifestError(
                f"{uri}: {name} belongs to {describe(parsed[0])}, outside the world size {world_size!r} this load runs "
                "with"
            )
        if parsed[0] == rank:
            parts[parsed[1]] = name
    if not parts:
        raise NotFound(
            f"{uri}: no file of {describe(rank)} named like {pattern.pattern!r}, and no {manifest_name(rank)}"
        )
    missing = sorted(set(range(max(parts) + 1)) - set(parts))
    if missing:
        raise ManifestError(
            f"{uri}: {describe(rank)} has parts up to {max(parts)} but not part {missing[0]} "
            f"({pattern.name(rank, missing[0])})"
        )
    return [store.join(uri, parts[number]) for number in sorted(parts)], None


def _rank_of(load: LoadOptions) -> tuple[Rank | None, Rank | None]:
    """The caller's rank and world size: the options', else ``torch.distributed``'s."""
    opts = load.own(ShardedStateOptions)
    if opts.rank is not None:
        _check_rank_shape(opts.rank, "rank")
        if opts.world_size is not None:
            _check_rank_shape(opts.world_size, "world_size")
            check_in_world(opts.rank, opts.world_size)
        return opts.rank, opts.world_size
    if opts.world_size is not None:
        raise InvalidOptionError("world_size without rank: pass rank= too (or leave both to torch.distributed)")
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return None, None


def _only_rank(store: Store, uri: str, names: set[str], opts: ShardedStateOptions) -> Rank:
    """Rank 0 of a state saved for a world of one; else the caller must say which rank it is."""
    for single, world in ((0, 1), ((0, 0), (1, 1))):
        if manifest_name(single) in names:
            manifest = _read_manifest(store, store.join(uri, manifest_name(single)))
            if manifest.world_size == world:
                return single
    ranks = _ranks_in(names, opts)
    if len(ranks) == 1 and next(iter(ranks)) in (0, (0, 0)):
        return next(iter(ranks))
    shown = ", ".join(describe(rank) for rank in sorted(ranks, key=str)[:4]) or "none"
    raise InvalidOptionError(
        f"{uri}: the sharded-state loader reads one rank's files (ranks here: {shown}): pass rank= (and world_size=), "
        "or initialise torch.distributed"
    )


def saved_ranks(store: Store, uri: str, opts: ShardedStateOptions | None = None) -> list[Rank]:
    """The ranks whose files the directory ``uri`` holds, in order; ``[]`` where ``uri`` is no directory ``store``
    can list.

    Example:
        >>> saved_ranks(store_for("model-tp2/"), "model-tp2/")  # doctest: +SKIP
        [0, 1]
    """
    if not store.lists or not store.is_dir(uri):
        return []
    return sorted(_ranks_in(set(store.list_names(uri)), opts or ShardedStateOptions()), key=_rank_order)


def _rank_order(rank: Rank) -> tuple[int, ...]:
    return rank if isinstance(rank, tuple) else (rank,)


def _ranks_in(names: set[str], opts: ShardedStateOptions) -> set[Rank]:
    """The ranks whose files are among ``names`` (by the shard pattern asked for, else both default ones)."""
    ranks: set[Rank] = set()
    for pattern in (
        [ShardPattern(opts.shard_pattern)]
        if opts.shard_pattern
        else [ShardPattern(DEFAULT_PATTERN), ShardPattern(PP_PATTERN)]
    ):
        ranks |= {parsed[0] for parsed in map(pattern.parse, names) if parsed is not None}
    return ranks


def _check_rank_shape(value: object, what: str) -> None:
    if not is_rank(value):
        raise InvalidOptionError(f"{what} must be a non-negative integer or a (pp, tp) pair of them, got {value!r}")


def _read_manifest(store: Store, path: str) -> Manifest:
    return parse_manifest(read_small_file(store, path, MAX_MANIFEST_BYTES, ManifestError, "a manifest"), path)


def _files_of_manifest(
    store: Store,
    uri: str,
    names: set[str],
    manifest: Manifest,
    rank: Rank,
    world_size: Rank | None,
    opts: ShardedStateOptions,
) -> list[str]:
    where = store.join(uri, manifest_name(rank))
    if manifest.rank != rank:
        raise ManifestError(f"{where}: written for {describe(manifest.rank)}, found as {describe(rank)}'s manifest")
    if world_size is not None and manifest.world_size != world_size:
        raise ManifestError(
            f"{where}: saved for a world size of {manifest.world_size!r}; this load runs with {world_size!r}"
        )
    if opts.shard_pattern is not None and opts.shard_pattern != manifest.pattern:
        raise ManifestError(f"{where}: files are named {manifest.pattern!r}, not shard_pattern={opts.shard_pattern!r}")
    pattern = ShardPattern(manifest.pattern)
    listed = [entry.name for entry in manifest.files]
    missing = [name for name in listed if name not in names]
    if missing:
        raise ManifestError(
            f"{where}: lists {missing[0]}, which is not in {uri} ({len(missing)} of {len(listed)} files missing)"
        )
    for name in sorted(names):
        parsed = pattern.parse(name)
        if parsed is None:
            continue
        if not in_world(parsed[0], manifest.world_size):
            raise ManifestError(
                f"{uri}: {name} belongs to {describe(parsed[0])}, outside the saved world size {manifest.world_size!r}"
            )
        if parsed[0] == rank and name not in listed:
            raise ManifestError(
                f"{uri}: {name} is a file of {describe(rank)} that {where} does not list (an extra file)"
            )
    return [store.join(uri, name) for name in listed]


def _check_against_manifest(store: Store, plan: LoadPlan, manifest: Manifest, paths: list[str]) -> None:
    """The files' sizes and every tensor's place, as the manifest recorded them (checked before any read)."""
    sizes = {spec.path: spec.size for spec in plan.files}
    in_plan = {(spec.file, spec.name): spec for spec in plan.tensors}
    for path, entry in zip(paths, manifest.files, strict=True):
        if sizes[path] != entry.size:
            raise ManifestError(
                f"{path}: {sizes[path]} bytes, the manifest says {entry.size} (the file changed after the save)"
            )
        for tensor in entry.tensors:
            spec = in_plan.get((path, tensor.name))
            if spec is not None and (spec.offset, spec.nbytes) != (tensor.offset, tensor.nbytes):
                raise ManifestError(
                    f"{path}: tensor {tensor.name!r} is at bytes {spec.offset}-{spec.end}, the manifest says "
                    f"{tensor.offset}-{tensor.offset + tensor.nbytes}"
                )


def _read(
    store: Store, plan: LoadPlan, opts: LoadOptions, manifest: Manifest | None, destination: Destination
) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the plan (checking every tensor with ``verify``); with a manifest, check at the end that the
    rank was not saved again meanwhile: the manifest a save rewrites must be the one planned."""
    if manifest is None:
        yield from read_tensors(store, plan, opts, destination)
        return
    verify = opts.own(ShardedStateOptions).verify
    checksums = _checksums_by_tensor(plan, manifest) if verify else {}
    if verify:
        _verify_headers(store, plan, manifest)
    with contextlib.closing(read_tensors(store, plan, opts, destination)) as tensors:
        for name, tensor in tensors:
            if verify:
                _verify_tensor(name, tensor, checksums[name], manifest.checksum)
            yield name, tensor
    _check_same_save(store, plan.uri, manifest)


def _check_same_save(store: Store, uri: str, manifest: Manifest) -> None:
    """Raise :class:`SourceChangedError` if ``manifest``'s rank was saved again (or is being saved) since the plan."""
    path = store.join(uri, manifest_name(manifest.rank))
    try:
        now = _read_manifest(store, path)
    except (NotFound, ManifestError) as error:
        raise SourceChangedError(
            f"{uri}: {describe(manifest.rank)} was being saved again while it loaded ({error}); load again"
        ) from None
    if now != manifest:
        raise SourceChangedError(
            f"{uri}: {describe(manifest.rank)} was saved again while it loaded (its manifest changed); load again"
        )


def _checksums_by_tensor(plan: LoadPlan, manifest: Manifest) -> dict[str, tuple[str, int, int, str]]:
    """Tensor name -> (file, offset, nbytes, checksum) for every tensor of the plan."""
    by_name = {spec.name: spec.file for spec in plan.tensors}
    names = {path.rsplit("/", 1)[-1]: path for path in dict.fromkeys(by_name.values())}
    found = {}
    for entry in manifest.files:
        for tensor in entry.tensors:
            if tensor.name in by_name and entry.name in names:
                found[tensor.name] = (names[entry.name], tensor.offset, tensor.nbytes, tensor.checksum)
    unlisted = sorted(set(by_name) - set(found))
    if unlisted:
        raise ManifestError(f"{by_name[unlisted[0]]}: holds tensor {unlisted[0]!r}, which the manifest does not list")
    return found


def _verify_headers(store: Store, plan: LoadPlan, manifest: Manifest) -> None:
    entries = {entry.name: entry for entry in manifest.files}
    for spec in plan.files:
        entry = entries[spec.path.rsplit("/", 1)[-1]]
        with contextlib.closing(store.open(spec.path)) as source:
            header = source.read(0, spec.data_offset)
        hasher = new_hasher(manifest.checksum)
        hasher.update(header)
        if hasher.hexdigest() != entry.header_checksum:
            raise IntegrityError(
                f"{spec.path}: the header (bytes 0-{spec.data_offset}) has {manifest.checksum} {hasher.hexdigest()}, "
                f"the manifest says {entry.header_checksum}"
            )


def _verify_tensor(name: str, tensor: torch.Tensor, expected: tuple[str, int, int, str], algorithm: str) -> None:
    path, offset, nbytes, checksum = expected
    hasher = new_hasher(algorithm)
    if nbytes:
        hasher.update(memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())))
    if hasher.hexdigest() != checksum:
        raise IntegrityError(
            f"{path}: tensor {name!r} (bytes {offset}-{offset + nbytes}) has {algorithm} {hasher.hexdigest()}, "
            f"the manifest says {checksum}: the file is corrupt"
        )
