"""Where a model's weights are, as a caller names them: a path, a URI, or a Hugging Face model id; and how much of a
local checkpoint the page cache holds (what an engine adapter weighs to pick how to read it)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from weightstream.planning.discover import find_files
from weightstream.sources.hub.ids import HUB_SCHEME, hub_uri, looks_like_repo_id
from weightstream.sources.hub.store import pin
from weightstream.sources.local.file import LocalStore
from weightstream.sources.local.pagecache import resident_fraction


def resolve_model(model: str, revision: str | None = None, storage_options: Mapping[str, object] | None = None) -> str:
    """The location loads of ``model`` should read: a local path or URI as it is; a Hugging Face id (``org/name``,
    or ``hf://...``) resolved once, as the engines resolve it (the Hugging Face cache first, ``HF_HUB_OFFLINE``
    honoured; ``storage_options`` as for ``hf://`` URIs, e.g. ``cache_dir``), to the cache's snapshot or to
    ``hf://org/name@<commit>``: the commit its revision names now, so every later read is of that commit.

    Raises:
        NotFound: an id not in the cache while offline, or not on the Hub.
        UnsupportedInputError: ``revision`` is not a branch, tag or commit.

    Example:
        >>> resolve_model("/models/llama")
        '/models/llama'
        >>> resolve_model("Qwen/Qwen3-0.6B")  # doctest: +SKIP
        '/root/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/c1899de289a04d12100db370d81485cdf75e47ca'
    """
    if model.startswith(HUB_SCHEME):
        uri = model
    elif "://" in model or os.path.exists(model) or not looks_like_repo_id(model):
        return model
    else:
        uri = hub_uri(model, revision)
    return pin(uri, storage_options)


def page_cache_residency(path: str | os.PathLike[str]) -> float:
    """The fraction (0 to 1) of a local checkpoint's bytes (a file, or every file of a checkpoint directory) that
    the page cache holds now.

    Raises:
        NotFound: no checkpoint there. UnsupportedInputError: not a safetensors checkpoint.

    Example:
        >>> page_cache_residency("model.safetensors")  # doctest: +SKIP
        1.0
    """
    sizes = {file: os.path.getsize(file) for file in find_files(LocalStore(), os.fspath(path)).files}
    return sum(resident_fraction(file) * size for file, size in sizes.items()) / max(1, sum(sizes.values()))
