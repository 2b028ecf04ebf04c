"""weightstream: LLM weights from storage into memory at the speed of the hardware.

Example:
    >>> import weightstream
    >>> weights = weightstream.load_weights("model/")  # doctest: +SKIP
"""

import importlib
from typing import TYPE_CHECKING

from weightstream.errors import (
    AccessDeniedError,
    BenchmarkError,
    CacheConfigError,
    CacheError,
    CacheFullError,
    CacheInUseError,
    CacheProtocolError,
    CacheRefusedError,
    CacheUnavailableError,
    CheckpointClosedError,
    DeviceMemoryError,
    DeviceUnavailableError,
    EngineUnavailableError,
    FleetPeerError,
    FleetUnavailableError,
    FormatError,
    HeaderError,
    HostMemoryError,
    IncompleteSaveError,
    IntegrityError,
    InvalidOptionError,
    LayerInUseError,
    LoaderRegistrationError,
    ManifestError,
    MemoryStillInUseError,
    MissingDependencyError,
    NotFound,
    OptionError,
    PeerError,
    SaveError,
    ShardIndexError,
    SliceIndexError,
    SliceTypeError,
    SliceValueError,
    SourceChangedError,
    SourceError,
    SourceTimeout,
    TensorNotFound,
    TruncatedFileError,
    UnknownFormatError,
    UnsupportedInputError,
    WeightsMismatchError,
    WeightstreamError,
)

if TYPE_CHECKING:
    from weightstream.checkpoint.calls import iter_layers, iter_weights, load_weights
    from weightstream.checkpoint.handle import Checkpoint, CheckpointStats
    from weightstream.checkpoint.models import page_cache_residency, resolve_model
    from weightstream.checkpoint.node_cache import NodeCache
    from weightstream.checkpoint.opening import open, resolve_format
    from weightstream.checkpoint.slices import TensorSlice
    from weightstream.options import LoadOptions
    from weightstream.readers.distributed import DistributedStats
    from weightstream.registry import available_loaders, register_loader
    from weightstream.save.saver import save_sharded_state

__version__ = "0.1.0"

_API = "weightstream.checkpoint.calls"
"""Imported with the first public name used: the API and the path of a local or cached safetensors load (so that the
first load itself imports nothing; ``benchmarks/fixed_costs.py``)."""
_IMPORTED_ON_USE = {
    "Checkpoint": "weightstream.checkpoint.handle",
    "CheckpointStats": "weightstream.checkpoint.handle",
    "DistributedStats": "weightstream.readers.distributed",
    "LoadOptions": "weightstream.options",
    "NodeCache": "weightstream.checkpoint.node_cache",
    "TensorSlice": "weightstream.checkpoint.slices",
    "available_loaders": "weightstream.registry",
    "iter_layers": _API,
    "iter_weights": _API,
    "load_weights": _API,
    "open": "weightstream.checkpoint.opening",
    "page_cache_residency": "weightstream.checkpoint.models",
    "register_loader": "weightstream.registry",
    "resolve_format": "weightstream.checkpoint.opening",
    "resolve_model": "weightstream.checkpoint.models",
    "save_sharded_state": "weightstream.save.saver",
}
"""The public names beyond the errors, imported on first use: ``import weightstream`` costs no torch import, so the
command line answers ``--help`` and ``--version`` at once."""


def __getattr__(name: str) -> object:
    if name not in _IMPORTED_ON_USE:
        raise AttributeError(f"module 'weightstream' has no attribute {name!r}")
    importlib.import_module(_API)
    value = getattr(importlib.import_module(_IMPORTED_ON_USE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_IMPORTED_ON_USE))


__all__ = [
    "AccessDeniedError",
    "BenchmarkError",
    "CacheConfigError",
    "CacheError",
    "CacheFullError",
    "CacheInUseError",
    "CacheProtocolError",
    "CacheRefusedError",
    "CacheUnavailableError",
    "Checkpoint",
    "CheckpointClosedError",
    "CheckpointStats",
    "DeviceMemoryError",
    "DeviceUnavailableError",
    "DistributedStats",
    "EngineUnavailableError",
    "FleetPeerError",
    "FleetUnavailableError",
    "FormatError",
    "HeaderError",
    "HostMemoryError",
    "IncompleteSaveError",
    "IntegrityError",
    "InvalidOptionError",
    "LayerInUseError",
    "LoadOptions",
    "LoaderRegistrationError",
    "ManifestError",
    "MemoryStillInUseError",
    "MissingDependencyError",
    "NodeCache",
    "NotFound",
    "OptionError",
    "PeerError",
    "SaveError",
    "ShardIndexError",
    "SliceIndexError",
    "SliceTypeError",
    "SliceValueError",
    "SourceChangedError",
    "SourceError",
    "SourceTimeout",
    "TensorNotFound",
    "TensorSlice",
    "TruncatedFileError",
    "UnknownFormatError",
    "UnsupportedInputError",
    "WeightsMismatchError",
    "WeightstreamError",
    "available_loaders",
    "iter_layers",
    "iter_weights",
    "load_weights",
    "open",
    "page_cache_residency",
    "register_loader",
    "resolve_format",
    "resolve_model",
    "save_sharded_state",
]
