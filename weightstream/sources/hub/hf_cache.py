"""The local Hugging Face cache, laid out as ``huggingface_hub`` writes it: ``models--org--name/refs/<revision>``
names a commit, ``snapshots/<commit>/`` links each file to ``blobs/``.
"""

from __future__ import annotations

import errno
import os

from weightstream.errors import NotFound, ShardIndexError, SourceError
from weightstream.formats.index import INDEX_NAME, MAX_INDEX_BYTES, parse_index
from weightstream.sources.hub.ids import COMMIT, HubReference
from weightstream.sources.local.regular import read_regular

MAX_REF_BYTES = 256


def cached_location(reference: HubReference, cache_dir: str) -> tuple[str | None, str]:
    """The cache's path for ``reference`` if it holds the whole checkpoint there (a file, or a directory with
    every shard its index names, or with a ``.safetensors`` file and no index), else None and what is missing.

    Example:
        >>> cached_location(HubReference("org/absent"), "/nonexistent")
        (None, 'no /nonexistent/models--org--absent/refs/main')
    """
    repository = os.path.join(cache_dir, reference.cache_folder)
    commit = reference.revision
    if not COMMIT.fullmatch(commit):
        ref_file = os.path.join(repository, "refs", reference.revision)
        try:
            commit = read_regular(ref_file, MAX_REF_BYTES).decode("ascii", "replace").strip()
        except NotFound:
            return None, f"no {ref_file}"
        except SourceError as error:
            if error.errno not in (errno.ENOTDIR, errno.EISDIR):
                raise
            return None, f"no {ref_file}"
        if not COMMIT.fullmatch(commit):
            return None, f"{ref_file} holds {commit[:60]!r}, not a commit hash"
    target = (
        os.path.join(repository, "snapshots", commit, *reference.path.split("/"))
        if reference.path
        else os.path.join(repository, "snapshots", commit)
    )
    if os.path.isfile(target):
        return target, ""
    if not os.path.isdir(target):
        return None, f"no {target}"
    index = os.path.join(target, INDEX_NAME)
    if os.path.isfile(index):
        if os.path.getsize(index) > MAX_INDEX_BYTES:
            raise ShardIndexError(
                f"{index}: {os.path.getsize(index)} bytes, over the {MAX_INDEX_BYTES}-byte limit for an index"
            )
        shards = parse_index(read_regular(index, MAX_INDEX_BYTES), index).shards
        missing = [shard for shard in shards if not os.path.isfile(os.path.join(target, shard))]
        if missing:
            return (
                None,
                f"{target} lacks {len(missing)} of the {len(shards)} shards its index names ({', '.join(missing[:3])})",
            )
        return target, ""
    if any(name.endswith(".safetensors") and os.path.isfile(os.path.join(target, name)) for name in os.listdir(target)):
        return target, ""
    return None, f"{target} holds no .safetensors file"
