"""Opening a checkpoint: options checked against the loader, the format resolved, the store (and the node cache in
front of it) opened, the headers read into a plan. What it returns, :class:`~weightstream.checkpoint.handle.Checkpoint`,
reads through that store and plan until it is closed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import torch

# The loader and the store of local files (and the loader of the node cache), imported with the API rather than at a
# process's first load: their modules cost ~5 ms once, fourteen times a warm zero-copy load of 512 MiB
# (benchmarks/fixed_costs.py).
import weightstream.loaders.safetensors
import weightstream.sources.local.file  # noqa: F401
from weightstream.checkpoint.handle import Checkpoint
from weightstream.errors import InvalidOptionError, OptionError, logger
from weightstream.formats.manifest import MANIFEST_PREFIX
from weightstream.loaders.base import Loader
from weightstream.options import LoadOptions
from weightstream.planning.plan import LoadPlan
from weightstream.registry import AUTO, bind_options, check_options, get_loader, option_names
from weightstream.sources import REMOTE_SCHEMES, Store, locate
from weightstream.sources.base import SharedMemory

log = logger(__name__)


def resolve_format(uri: str) -> str:
    """The format ``format="auto"`` picks for ``uri`` by its name (a local directory holding a weightstream
    manifest is read with ``sharded-state``, which ``weightstream.open`` sees once it looks there).

    Object-store URIs (``s3://``, ``gs://``, ``http(s)://``) resolve to ``"streaming"``
    (bounded memory, completion order), local paths to ``"safetensors"``. Either reads one
    ``.safetensors`` file, a directory (or prefix) with ``model.safetensors.index.json``, or
    one of ``*.safetensors`` files. (Pickle files are refused by the loader.) An ``hf://`` model id
    is resolved first: the Hugging Face cache's snapshot is local, the Hub is remote.

    Example:
        >>> resolve_format("model.safetensors"), resolve_format("s3://bucket/llama/")
        ('safetensors', 'streaming')
    """
    return "streaming" if uri.startswith(REMOTE_SCHEMES) else "safetensors"


FRAMEWORKS = ("pt", "torch")
"""``framework=`` values accepted, as ``safetensors.safe_open`` takes them (weightstream returns torch tensors)."""


def open(uri: str | os.PathLike[str], format: str = AUTO, **options: object) -> Checkpoint:
    """Open the checkpoint at ``uri``: options checked, loader picked, headers read, no tensor data yet.
    ``framework="pt"`` is accepted, as ``safetensors.safe_open`` takes it.

    Use it as a context manager (or call ``close()``): the checkpoint holds its store (and, for an
    object store, its connections) until then. Garbage collection closes it too.

    Raises:
        OptionError: an unknown option, before any I/O.
        WeightstreamError: any other failure, typed (see ``weightstream.errors``).

    Example:
        >>> with weightstream.open("model/") as checkpoint:  # doctest: +SKIP
        ...     embed = checkpoint.get_tensor("model.embed_tokens.weight")
        ...     rows = checkpoint.get_slice("lm_head.weight")[:1024]
    """
    started = time.perf_counter()
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str):
        raise OptionError(f"uri must be a path or a URI string, got {type(uri).__name__}")
    if not isinstance(format, str):
        raise OptionError(f"format must be a string, got {type(format).__name__}")
    framework = options.pop("framework", "pt")
    if framework not in FRAMEWORKS or format in FRAMEWORKS:
        raise InvalidOptionError(
            f"framework={framework!r}, format={format!r}: weightstream returns torch tensors (framework='pt', as "
            "safetensors.safe_open takes it, is accepted); the second argument of weightstream.open is the format"
        )
    opts, own = check_options(format, options)
    chosen = None if format == AUTO else _checked_loader(format, opts, own)
    store, location = locate(uri, opts.storage_options, opts.retry_policy())
    try:
        cache_not_used = None
        if opts.cache is not None:
            store, cache_not_used = _through_cache(store, opts)
        loader, opts = chosen or _checked_loader(_fitting(_automatic_format(store, location), own), opts, own)
        plan = loader.plan(store, location, opts)
        if not isinstance(plan, LoadPlan):
            raise TypeError(
                f"format {loader.name!r}: {type(loader).__module__}.{type(loader).__qualname__}.plan returned a "
                f"{type(plan).__name__}, not a weightstream.planning.plan.LoadPlan"
            )
    except BaseException:
        store.close()
        raise
    return Checkpoint(loader, store, plan, opts, time.perf_counter() - started, cache_not_used)


def _automatic_format(store: Store, location: str) -> str:
    """What ``format="auto"`` reads ``location`` with: ``sharded-state`` for a local directory holding a
    weightstream manifest (what ``convert`` and ``save_sharded_state`` write); else, through the node cache,
    ``safetensors`` (a remote checkpoint's bytes are local shared memory there: views beat streaming copies);
    else :func:`resolve_format`'s choice."""
    if (
        not location.startswith(REMOTE_SCHEMES)
        and store.is_dir(location)
        and any(name.startswith(MANIFEST_PREFIX) and name.endswith(".json") for name in store.list_names(location))
    ):
        return "sharded-state"
    return "safetensors" if isinstance(store, SharedMemory) else resolve_format(location)


def _fitting(automatic: str, own: Mapping[str, object]) -> str:
    """``format="auto"``'s choice, or its twin where only the twin takes the options given: ``safetensors`` and
    ``streaming`` read the same files, and ``max_inflight_bytes`` asks for the streaming window wherever the file
    is (logged)."""
    twins = {"safetensors": "streaming", "streaming": "safetensors"}
    if not own or automatic not in twins or set(own) <= set(option_names(automatic)):
        return automatic
    twin = twins[automatic]
    if not set(own) <= set(option_names(twin)):
        return automatic  # its loader says which option it refuses
    log.info("format='auto': %s asks for the %s loader, not %s", ", ".join(sorted(own)), twin, automatic)
    return twin


def _through_cache(store: Store, opts: LoadOptions) -> tuple[Store, str | None]:
    """``store`` read through the node cache ``opts.cache`` names; for ``"auto"`` without a daemon it can use,
    ``store`` itself and why."""
    from weightstream.nodecache.client import CachedStore
    from weightstream.nodecache.connection import connect

    client, why_not = connect(str(opts.cache))
    if client is None:
        return store, why_not
    copy_sources = None
    if torch.device(opts.device).type == "cuda":
        from weightstream.memory.devices import check_destination
        from weightstream.nodecache.gpu_import import SegmentCopies

        try:
            check_destination(opts.device, opts.pin_memory)
            copy_sources = SegmentCopies(torch.device(opts.device), strict=opts.zero_copy is True)
        except BaseException:
            client.close()
            raise
    return CachedStore(store, client, opts.storage_options, copy_sources), None


def _checked_loader(format: str, opts: LoadOptions, own: Mapping[str, object]) -> tuple[Loader, LoadOptions]:
    """The loader of ``format`` and the options with its own bound, once it accepts them all."""
    loader = get_loader(format)
    opts = bind_options(loader, opts, own)
    loader.check(opts)
    return loader, opts
