"""What the engine adapters share: the load formats they offer, the options they pass through, and
the completeness check engines do not do themselves."""

from __future__ import annotations

import importlib
from collections.abc import Collection, Mapping
from types import ModuleType
from typing import Any

from weightstream.errors import EngineUnavailableError, InvalidOptionError, WeightsMismatchError
from weightstream.options import LoadOptions
from weightstream.registry import available_loaders


def engine_formats() -> dict[str, str]:
    """Engine load-format name -> weightstream format: ``weightstream`` (``auto``: safetensors locally,
    streaming from object stores) and ``weightstream-<name>`` for every registered loader, third-party
    ones included.

    Example:
        >>> formats = engine_formats()
        >>> formats["weightstream"], formats["weightstream-sharded-state"]
        ('auto', 'sharded-state')
    """
    return {"weightstream": "auto", **{f"weightstream-{name}": name for name in available_loaders()}}


ENGINE_OWNED = frozenset({"device", "format", "process_group", "rank", "world_size"})
"""Options the engine decides (where its parameters are, its ranks); refused in the extra config."""


def import_engine(module: str, install: str) -> ModuleType:
    """Import an engine's module, or raise ``EngineUnavailableError`` saying how to install it.

    Example:
        >>> import_engine("no_such_engine", "pip install no-such-engine")
        Traceback (most recent call last):
        ...
        weightstream.errors.EngineUnavailableError: this weightstream adapter needs no_such_engine, which is not installed here (pip install no-such-engine)
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise EngineUnavailableError(f"this weightstream adapter needs {module.split('.')[0]}, which is not installed here ({install})") from error


def loader_options(extra: Mapping[str, Any] | None, load_format: str) -> tuple[str | None, dict[str, Any]]:
    """Split an engine's extra loader config into a weights location (``uri``) and weightstream options,
    checked now so that a bad option fails at engine start, not after the model is built.

    Example:
        >>> loader_options({"uri": "s3://bucket/llama", "threads": 16}, "weightstream")
        ('s3://bucket/llama', {'threads': 16})
    """
    options = dict(extra or {})
    uri = options.pop("uri", None)
    if uri is not None and not isinstance(uri, str):
        raise InvalidOptionError(f"{load_format}: 'uri' in the extra loader config must be a string, got {type(uri).__name__}")
    owned = sorted(ENGINE_OWNED & options.keys())
    if owned:
        raise InvalidOptionError(f"{load_format}: {', '.join(owned)} in the extra loader config: the engine decides these")
    LoadOptions.from_kwargs(**options)
    return uri, options


def check_filled(parameters: Collection[str], filled: Collection[str], uri: str) -> None:
    """Raise ``WeightsMismatchError`` naming the model parameters the checkpoint at ``uri`` did not fill.

    Example:
        >>> check_filled({"lm_head.weight", "model.norm.weight"}, {"model.norm.weight"}, "/models/llama")
        Traceback (most recent call last):
        ...
        weightstream.errors.WeightsMismatchError: /models/llama did not fill 1 of the model's 2 parameters: lm_head.weight
    """
    missing = sorted(set(parameters) - set(filled))
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing) - 8} more)" if len(missing) > 8 else "")
        raise WeightsMismatchError(f"{uri} did not fill {len(missing)} of the model's {len(parameters)} parameters: {shown}")
