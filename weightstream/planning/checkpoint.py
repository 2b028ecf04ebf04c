"""Which files make up a safetensors checkpoint: one file, an indexed directory, or a plain directory."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Collection, Mapping

from weightstream.errors import FormatError, NotFound, ShardIndexError, TensorNotFound, UnsupportedInputError
from weightstream.formats.index import INDEX_NAME, MAX_INDEX_BYTES, ShardIndex, parse_index
from weightstream.formats.safetensors import Header
from weightstream.planning.headers import ParseBudget, read_header
from weightstream.planning.plan import FileSpec, LoadPlan, TensorSpec
from weightstream.sources.base import Source, Store
from weightstream.workers import WorkerPool

SAFETENSORS_SUFFIX = ".safetensors"
HEADER_READERS = 8
"""Headers read at once while planning a checkpoint of many files."""
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""Files that torch.save / pickle write. weightstream never unpickles anything."""


@dataclasses.dataclass(frozen=True)
class CheckpointFiles:
    """The files of one checkpoint and, for the sharded layout, its index."""

    files: tuple[str, ...]
    index: ShardIndex | None = None
    index_uri: str | None = None
    shard_uris: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """For the indexed layout: shard name (as the index spells it) -> URI."""


def find_files(store: Store, uri: str) -> CheckpointFiles:
    """Resolve ``uri`` (a file or a directory) into the safetensors files to read.

    Raises:
        NotFound: nothing at ``uri``, no safetensors file in the directory, or a shard the index names is missing.
        UnsupportedInputError: a pickle-based file (``.bin``, ``.pt``, ...), refused unread.
        ShardIndexError: the index is malformed.

    Example:
        >>> find_files(LocalStore(), "model.safetensors").files  # doctest: +SKIP
        ('model.safetensors',)
    """
    if not store.exists(uri):
        raise NotFound(f"{uri}: no such file or directory")
    if not store.is_dir(uri):
        _refuse_pickle(uri)
        return CheckpointFiles(files=(uri,))
    names = store.list_names(uri) if store.lists else _known_names(store, uri)
    if INDEX_NAME in names:
        index_uri = store.join(uri, INDEX_NAME)
        index = _read_index(store, index_uri)
        shard_uris = {}
        for shard in index.shards:
            shard_uri = store.join(uri, shard)
            if not store.exists(shard_uri):
                raise NotFound(f"{index_uri}: names shard {shard!r}, which does not exist in {uri}")
            _refuse_pickle(shard_uri)
            shard_uris[shard] = shard_uri
        return CheckpointFiles(
            files=tuple(shard_uris.values()), index=index, index_uri=index_uri, shard_uris=shard_uris
        )
    shards = [name for name in names if name.endswith(SAFETENSORS_SUFFIX) and not store.is_dir(store.join(uri, name))]
    if shards:
        return CheckpointFiles(files=tuple(store.join(uri, name) for name in shards))
    pickles = [name for name in names if name.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise UnsupportedInputError(
            f"{uri}: holds only pickle-based weights ({', '.join(pickles[:3])}); weightstream never unpickles files. "
            f"Convert them to safetensors first."
        )
    raise NotFound(f"{uri}: no {SAFETENSORS_SUFFIX} files and no {INDEX_NAME} in this directory")


def _known_names(store: Store, uri: str) -> list[str]:
    """For a store without listings: the index, asked for by name, or an error saying what to name."""
    if store.exists(store.join(uri, INDEX_NAME)):
        return [INDEX_NAME]
    raise NotFound(
        f"{uri}: no {INDEX_NAME} at this URL, and this store has no directory listing: "
        f"name a {SAFETENSORS_SUFFIX} file or a directory that holds an index"
    )


def _refuse_pickle(uri: str) -> None:
    if uri.endswith(PICKLE_SUFFIXES):
        raise UnsupportedInputError(
            f"{uri}: {os.path.splitext(uri)[1]} files are pickles (torch.save); weightstream never unpickles files. "
            f"Convert it to safetensors first."
        )


def _read_index(store: Store, index_uri: str) -> ShardIndex:
    return parse_index(read_small_file(store, index_uri, MAX_INDEX_BYTES, ShardIndexError, "an index"), index_uri)


def read_small_file(store: Store, uri: str, limit: int, error: type[FormatError], what: str) -> bytes:
    """The whole of a small file (an index, a manifest): ``error`` if it is over ``limit`` bytes.

    Example:
        >>> index = "model.safetensors.index.json"
        >>> read_small_file(LocalStore(), index, 1 << 20, ShardIndexError, "an index")  # doctest: +SKIP
    """
    with contextlib.closing(store.open(uri)) as source:
        if source.size > limit:
            raise error(f"{uri}: {source.size} bytes, over the limit of {limit} for {what}")
        return source.read(0, source.size)


def read_plan(
    store: Store,
    uri: str,
    wants: Callable[[str], bool],
    required: Collection[str] = (),
    checkpoint: CheckpointFiles | None = None,
    parse_budget: ParseBudget | None = None,
) -> LoadPlan:
    """Read every header of the checkpoint at ``uri`` (or of ``checkpoint``'s files) and plan the tensors ``wants``
    selects, their parses held within ``parse_budget`` (default: a budget of its own, ``ParseBudget()``).

    ``required`` names must all exist. Headers are validated in full before anything
    else is allocated; the index (if any) must agree with the shards exactly.

    Raises:
        HeaderError, TruncatedFileError, ShardIndexError, NotFound, UnsupportedInputError, TensorNotFound.

    Example:
        >>> plan = read_plan(LocalStore(), "model.safetensors", lambda name: True)  # doctest: +SKIP
    """
    checkpoint = find_files(store, uri) if checkpoint is None else checkpoint
    files, tensors, seen = [], [], {}
    # Each header is a round trip to an object store: read them side by side. map() raises the
    # error of the first failing file in checkpoint order, as reading them one by one would. One
    # header is read on this thread: starting a pool costs more than a warm local header (0.3 ms).
    budget = ParseBudget() if parse_budget is None else parse_budget
    if len(checkpoint.files) == 1:
        opened = [_header_of(store, checkpoint.files[0], budget)]
    else:
        pool = WorkerPool(min(HEADER_READERS, len(checkpoint.files)), "weightstream-plan")
        try:
            reads = [pool.submit(_header_of, store, path, budget) for path in checkpoint.files]
            opened = [read.result() for read in reads]
        finally:
            pool.shutdown()
    for path, (source, header) in zip(checkpoint.files, opened, strict=True):
        files.append(
            FileSpec(
                path=path,
                size=source.size,
                data_offset=header.data_offset,
                metadata=header.metadata,
                version=source.version,
            )
        )
        for entry in header.entries:
            if entry.name in seen:
                raise FormatError(f"tensor {entry.name!r} is in both {seen[entry.name]} and {path}")
            seen[entry.name] = path
            if wants(entry.name):
                tensors.append(
                    TensorSpec(
                        entry.name,
                        entry.dtype,
                        entry.shape,
                        path,
                        header.data_offset + entry.begin,
                        entry.end - entry.begin,
                    )
                )
    if checkpoint.index is not None:
        _check_index(checkpoint, seen)
    missing = sorted(set(required) - set(seen))
    if missing:
        shown = ", ".join(repr(name) for name in missing[:5])
        raise TensorNotFound(f"{uri}: {len(missing)} requested tensor(s) not in the checkpoint: {shown}")
    return LoadPlan(uri=uri, files=tuple(files), tensors=tuple(tensors))


def _header_of(store: Store, path: str, budget: ParseBudget) -> tuple[Source, Header]:
    """The (closed) source of ``path``, which still tells its size and version, and its validated header."""
    with contextlib.closing(store.open(path)) as source:
        return source, read_header(source, budget)


def _check_index(checkpoint: CheckpointFiles, found: dict[str, str]) -> None:
    index, index_uri = checkpoint.index, checkpoint.index_uri
    for name, shard in index.weight_map.items():
        if name not in found:
            raise ShardIndexError(f"{index_uri}: lists tensor {name!r} in {shard!r}, but no shard holds it")
        if found[name] != checkpoint.shard_uris[shard]:
            raise ShardIndexError(f"{index_uri}: lists tensor {name!r} in {shard!r}, but it is in {found[name]}")
    extra = sorted(set(found) - set(index.weight_map))
    if extra:
        raise ShardIndexError(
            f"{index_uri}: shard {found[extra[0]]} holds tensor {extra[0]!r}, which the index does not list "
            f"({len(extra)} such)"
        )
