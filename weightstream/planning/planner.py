"""Planning a checkpoint: its files found, every header read (side by side for many files) and checked, merged into
one ``LoadPlan`` of the tensors asked for."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection

from weightstream.errors import FormatError, ShardIndexError, TensorNotFound
from weightstream.formats.safetensors import Header
from weightstream.planning.discover import CheckpointFiles, find_files
from weightstream.planning.headers import ParseBudget, read_header
from weightstream.planning.plan import FileSpec, LoadPlan, TensorSpec
from weightstream.sources.base import Source, Store
from weightstream.workers import WorkerPool

HEADER_READERS = 8
"""Headers read at once while planning a checkpoint of many files."""


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
