"""The format registry: name -> loader class.

Built-in loaders are listed as dotted paths and imported on first use; third-party
loaders come from the ``weightstream.loaders`` entry-point group, also as dotted paths,
imported only when asked for. The registry is read-only to the world
(:data:`loaders` is a :class:`types.MappingProxyType`); :func:`register_loader` adds to it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.metadata
import types
from collections.abc import Callable, Collection, Mapping
from typing import TypeVar, overload

from weightstream.errors import InvalidOptionError, LoaderRegistrationError, OptionError, UnknownFormatError, logger
from weightstream.loaders.base import Loader
from weightstream.options import LoadOptions, core_option_names

log = logger(__name__)

ENTRY_POINT_GROUP = "weightstream.loaders"

BUILTIN_LOADERS: dict[str, str] = {
    "safetensors": "weightstream.loaders.safetensors:SafetensorsLoader",
    "streaming": "weightstream.loaders.streaming:StreamingLoader",
    "layered": "weightstream.loaders.layered:LayeredLoader",
    "sharded-state": "weightstream.loaders.sharded_state:ShardedStateLoader",
    "distributed": "weightstream.loaders.distributed:DistributedLoader",
}
"""Built-in loaders by dotted path (``module:Class``)."""

_registry: dict[str, str | type] = dict(BUILTIN_LOADERS)
loaders = types.MappingProxyType(_registry)
"""Read-only view: name -> loader class or the dotted path it will be imported from."""

_entry_points_loaded = False

LoaderClass = TypeVar("LoaderClass", bound=type)


@overload
def register_loader(
    name: str, loader: None = None, *, clobber: bool = False
) -> Callable[[LoaderClass], LoaderClass]: ...
@overload
def register_loader(name: str, loader: str, *, clobber: bool = False) -> str: ...
@overload
def register_loader(name: str, loader: LoaderClass, *, clobber: bool = False) -> LoaderClass: ...
def register_loader(
    name: str, loader: str | type | None = None, *, clobber: bool = False
) -> str | type | Callable[[LoaderClass], LoaderClass]:
    """Register ``loader`` (a class or a ``"module:Class"`` path) under ``name``.

    Usable as a decorator. A loader with options of its own declares them as a dataclass in its
    ``options`` class attribute: :func:`bind_options` validates them (by constructing it) before any I/O.
    Registering a different loader under a taken name raises unless ``clobber=True``; registering the same one again
    is a no-op.

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
        raise LoaderRegistrationError(
            f"loader {name!r} must be a class or a 'module:Class' string, got {type(loader).__name__}"
        )
    if isinstance(loader, str) and loader.count(":") != 1:
        raise LoaderRegistrationError(f"loader {name!r}: dotted path {loader!r} must look like 'package.module:Class'")
    _load_entry_points()
    current = _registry.get(name)
    if current is not None and not clobber and not _same(current, loader):
        raise LoaderRegistrationError(
            f"format {name!r} is already registered to {_describe(current)}; pass clobber=True to replace it with "
            f"{_describe(loader)}"
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
    cls = loader_class(name)
    instance = cls()
    if not isinstance(instance, Loader):
        raise LoaderRegistrationError(
            f"format {name!r}: {_describe(cls)} lacks name, check(), plan() or iter_weights()"
        )
    options = options_class(cls)
    if options is not None and not dataclasses.is_dataclass(options):
        raise LoaderRegistrationError(f"format {name!r}: {_describe(cls)}.options must be a dataclass, got {options!r}")
    return instance


def options_class(loader: object) -> type | None:
    """The dataclass of a loader's own options (its ``options`` attribute), or ``None`` if it has none.

    Example:
        >>> options_class(get_loader("layered")).__name__, options_class(get_loader("safetensors"))
        ('LayeredOptions', None)
    """
    options = getattr(loader, "options", None)
    return options if isinstance(options, type) else None


AUTO = "auto"
AUTO_CHOICES = ("safetensors", "streaming", "sharded-state")
"""The formats ``format="auto"`` picks from (local files and the node cache: safetensors; objects: streaming; a
directory with a weightstream manifest: sharded-state)."""


def check_options(
    format: str, options: Mapping[str, object], decided_elsewhere: Collection[str] = ()
) -> tuple[LoadOptions, dict[str, object]]:
    """The core options of ``options``, checked, and the rest, each checked to be an option of ``format``'s loader
    (for ``"auto"``: of a loader it may pick), before any I/O. Only those loaders are imported (an unknown name
    imports the others, to say whose option it is).

    An unknown name is refused with the options the caller may set: the core ones (less ``decided_elsewhere``, the
    ones an engine sets itself) and, apart, the loader's own.

    Raises:
        OptionError: a name that is neither a core option nor an option of any registered loader.
        InvalidOptionError: an option of another loader, or a core option's invalid value.

    Example:
        >>> core, rest = check_options("layered", {"threads": 4, "prefetch_layers": 2})
        >>> core.threads, rest
        (4, {'prefetch_layers': 2})
    """
    core_names = set(core_option_names())
    own = {name: value for name, value in options.items() if name not in core_names}
    core = LoadOptions.from_kwargs(**{name: value for name, value in options.items() if name in core_names})
    formats = AUTO_CHOICES if format == AUTO else (format,)
    accepted = {name for candidate in formats for name in _own_option_names(loader_class(candidate))} if own else set()
    for name in own:
        if name in accepted:
            continue
        owner = owner_of_option(name)
        if owner is not None:
            user = f"the {format} loader" if format != AUTO else f"format='auto' ({' or '.join(AUTO_CHOICES)})"
            raise InvalidOptionError(f"{name}: an option of format={owner!r}; {user} does not use it")
        whose = (
            f"the {format} loader" if format != AUTO else f"the loaders format='auto' picks from ({', '.join(formats)})"
        )
        loaders_own = ", ".join(sorted(accepted - set(decided_elsewhere))) or "none"
        raise OptionError(
            f"unknown option(s) {', '.join(sorted(set(own) - accepted))}; known options: "
            f"{', '.join(sorted(core_names - set(decided_elsewhere)))}; options of {whose}: {loaders_own}"
            f"{_did_you_mean(name)}"
        )
    return core, own


def _did_you_mean(name: str) -> str:
    """A hint naming the option of any registered loader closest to the mistyped ``name``, if one is close."""
    close = difflib.get_close_matches(name, [*core_option_names(), *all_loader_option_names()], n=1)
    if not close:
        return ""
    owner = owner_of_option(close[0])
    return f"; did you mean {close[0]}" + (f" (an option of format={owner!r})" if owner else "") + "?"


def option_names(format: str) -> tuple[str, ...]:
    """The options of ``format``'s loader besides the core ones (imports it).

    Example:
        >>> option_names("streaming"), option_names("safetensors")
        (('max_inflight_bytes',), ())
    """
    return _own_option_names(loader_class(format))


def _own_option_names(loader: type) -> tuple[str, ...]:
    declared = options_class(loader)
    if declared is None or not dataclasses.is_dataclass(declared):
        return ()
    return tuple(field.name for field in dataclasses.fields(declared))


def bind_options(loader: Loader, opts: LoadOptions, own: Mapping[str, object]) -> LoadOptions:
    """``opts`` with ``loader``'s own options built from ``own`` (each checked by its dataclass).

    Raises:
        InvalidOptionError: an option of another loader, or an invalid value.
        OptionError: a name no loader knows, or a value of the wrong type.

    Example:
        >>> bind_options(get_loader("layered"), LoadOptions(), {"prefetch_layers": 2}).loader_options
        LayeredOptions(prefetch_layers=2, layer_rule=None, layer_hook=None, copy_layers=False)
    """
    declared = options_class(loader)
    accepted = {field.name for field in dataclasses.fields(declared)} if declared is not None else set()
    for name in own:
        if name in accepted:
            continue
        owner = owner_of_option(name)
        if owner is None:
            raise OptionError(
                f"unknown option {name!r} for format={loader.name!r}; its options: "
                f"{', '.join(sorted(accepted)) or 'none'}"
            )
        raise InvalidOptionError(f"{name}: an option of format={owner!r}; the {loader.name} loader does not use it")
    return dataclasses.replace(opts, loader_options=None if declared is None else declared(**own))


def owner_of_option(name: str) -> str | None:
    """The first registered format (built-ins first) whose own options include ``name``.

    Example:
        >>> owner_of_option("max_inflight_bytes"), owner_of_option("no_such_option")
        ('streaming', None)
    """
    for format, names in _options_by_format().items():
        if name in names:
            return format
    return None


def all_loader_option_names() -> list[str]:
    """Every registered loader's own options' names (those of loaders that cannot be imported left out)."""
    return sorted({name for names in _options_by_format().values() for name in names})


def _options_by_format() -> dict[str, tuple[str, ...]]:
    _load_entry_points()
    found = {}
    for format in sorted(_registry, key=lambda name: (name not in BUILTIN_LOADERS, name)):
        try:
            names = _own_option_names(loader_class(format))
        except LoaderRegistrationError:
            continue  # a broken third-party entry is reported when it is asked for, not here
        if names:
            found[format] = names
    return found


def loader_class(name: str) -> type:
    """The class registered under ``name``, imported if it was a dotted path (not instantiated).

    Raises:
        UnknownFormatError: no such format.
        LoaderRegistrationError: it could not be imported.
    """
    if name not in _registry:  # entry points add names, never replace one (a built-in's load reads none: 2.5 ms)
        _load_entry_points()
    if name not in _registry:
        raise UnknownFormatError(f"unknown format {name!r}; known formats: {', '.join(sorted(_registry))}")
    entry = _registry[name]
    return _import(name, entry) if isinstance(entry, str) else entry


def _import(name: str, path: str) -> type:
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        hint = (
            " (reinstall weightstream)"
            if name in BUILTIN_LOADERS
            else f" (is the package providing {module_name!r} installed?)"
        )
        raise LoaderRegistrationError(f"format {name!r}: cannot import {module_name!r}: {error}{hint}") from error
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise LoaderRegistrationError(
            f"format {name!r}: module {module_name!r} has no attribute {attribute!r}"
        ) from None


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name in _registry and not _same(_registry[entry_point.name], entry_point.value):
            log.warning(
                "entry point %s=%s ignored: format already registered to %s",
                entry_point.name,
                entry_point.value,
                _describe(_registry[entry_point.name]),
            )
            continue
        _registry[entry_point.name] = entry_point.value


def _same(first: str | type, second: str | type) -> bool:
    return _describe(first) == _describe(second)


def _describe(loader: str | type | Callable) -> str:
    return loader if isinstance(loader, str) else f"{loader.__module__}:{loader.__qualname__}"
