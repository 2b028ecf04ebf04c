"""The format registry: name -> loader class.

Built-in loaders are listed as dotted paths and imported on first use; third-party
loaders come from the ``weightstream.loaders`` entry-point group, also as dotted paths,
imported only when asked for. The registry is read-only to the world
(:data:`loaders` is a :class:`types.MappingProxyType`); :func:`register_loader` adds to it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import types
from collections.abc import Callable
from typing import Any, TypeVar, Union

from weightstream.errors import LoaderRegistrationError, UnknownFormatError
from weightstream.loaders.base import Loader

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "weightstream.loaders"

BUILTIN_LOADERS: dict[str, str] = {
    "safetensors": "weightstream.loaders.safetensors:SafetensorsLoader",
    "streaming": "weightstream.loaders.streaming:StreamingLoader",
    "layered": "weightstream.loaders.layered:LayeredLoader",
    "sharded-state": "weightstream.loaders.sharded_state:ShardedStateLoader",
    "distributed": "weightstream.loaders.distributed:DistributedLoader",
}
"""Built-in loaders by dotted path (``module:Class``)."""

_registry: dict[str, Union[str, type]] = dict(BUILTIN_LOADERS)
loaders = types.MappingProxyType(_registry)
"""Read-only view: name -> loader class or the dotted path it will be imported from."""

_entry_points_loaded = False

LoaderClass = TypeVar("LoaderClass", bound=type)


def register_loader(name: str, loader: Union[str, type, None] = None, *, clobber: bool = False) -> Any:
    """Register ``loader`` (a class or a ``"module:Class"`` path) under ``name``.

    Usable as a decorator. Registering a different loader under a taken name raises
    unless ``clobber=True``; registering the same one again is a no-op.

    Raises:
        LoaderRegistrationError: the name is taken, empty, or ``loader`` is neither a class nor a dotted path.

    Example:
        >>> @register_loader("my-format")
        ... class MyLoader:
        ...     name = "my-format"
        ...     def check(self, opts): ...
        ...     def plan(self, store, uri, opts): ...
        ...     def iter_weights(self, store, plan, opts): ...
    """
    if loader is None:
        def decorate(cls: LoaderClass) -> LoaderClass:
            register_loader(name, cls, clobber=clobber)
            return cls

        return decorate
    if not isinstance(name, str) or not name:
        raise LoaderRegistrationError(f"loader name must be a non-empty string, got {name!r}")
    if not isinstance(loader, (str, type)):
        raise LoaderRegistrationError(f"loader {name!r} must be a class or a 'module:Class' string, got {type(loader).__name__}")
    if isinstance(loader, str) and loader.count(":") != 1:
        raise LoaderRegistrationError(f"loader {name!r}: dotted path {loader!r} must look like 'package.module:Class'")
    _load_entry_points()
    current = _registry.get(name)
    if current is not None and not clobber and not _same(current, loader):
        raise LoaderRegistrationError(
            f"format {name!r} is already registered to {_describe(current)}; pass clobber=True to replace it with {_describe(loader)}"
        )
    _registry[name] = loader
    return loader


def available_loaders() -> list[str]:
    """Names of every registered format, built-in and third-party, sorted.

    Example:
        >>> "safetensors" in available_loaders()
        True
    """
    _load_entry_points()
    return sorted(_registry)


def get_loader(name: str) -> Loader:
    """An instance of the loader registered under ``name``.

    Raises:
        UnknownFormatError: no such format; the message lists the known ones.
        LoaderRegistrationError: the loader could not be imported or is not a loader.
    """
    _load_entry_points()
    if name not in _registry:
        raise UnknownFormatError(f"unknown format {name!r}; known formats: {', '.join(sorted(_registry))}")
    entry = _registry[name]
    cls = _import(name, entry) if isinstance(entry, str) else entry
    instance = cls()
    if not isinstance(instance, Loader):
        raise LoaderRegistrationError(f"format {name!r}: {_describe(cls)} lacks name, check(), plan() or iter_weights()")
    return instance


def _import(name: str, path: str) -> type:
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        hint = " (reinstall weightstream)" if name in BUILTIN_LOADERS else f" (is the package providing {module_name!r} installed?)"
        raise LoaderRegistrationError(f"format {name!r}: cannot import {module_name!r}: {error}{hint}") from error
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise LoaderRegistrationError(f"format {name!r}: module {module_name!r} has no attribute {attribute!r}") from None


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name in _registry and not _same(_registry[entry_point.name], entry_point.value):
            log.warning("entry point %s=%s ignored: format already registered to %s",
                        entry_point.name, entry_point.value, _describe(_registry[entry_point.name]))
            continue
        _registry[entry_point.name] = entry_point.value


def _same(first: Union[str, type], second: Union[str, type]) -> bool:
    return _describe(first) == _describe(second)


def _describe(loader: Union[str, type, Callable]) -> str:
    return loader if isinstance(loader, str) else f"{loader.__module__}:{loader.__qualname__}"
