"""Which files make up a safetensors checkpoint: one file, an indexed directory, or a plain directory."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping

from weightstream.errors import FormatError, NotFound, ShardIndexError, UnsupportedInputError
from weightstream.formats.index import INDEX_NAME, MAX_INDEX_BYTES, ShardIndex, parse_index
from weightstream.sources.base import Store
from weightstream.sources.hub.ids import looks_like_repo_id

SAFETENSORS_SUFFIX = ".safetensors"
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
        model_id = uri.count("/") == 1 and looks_like_repo_id(uri) and not uri.endswith((SAFETENSORS_SUFFIX, ".json"))
        hint = f"; did you mean the Hugging Face model hf://{uri}?" if model_id else ""
        raise NotFound(f"{uri}: no such file or directory{hint}")
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
