"""weightstream: LLM weights from storage into memory at the speed of the hardware.

Example:
    >>> import weightstream
    >>> weights = weightstream.load_weights("model/")  # doctest: +SKIP
"""

import importlib

from weightstream.checkpoint.calls import iter_layers, iter_weights, load_weights
from weightstream.checkpoint.handle import Checkpoint, CheckpointStats
from weightstream.checkpoint.opening import open, resolve_format
from weightstream.checkpoint.slices import TensorSlice
from weightstream.errors import (
    AccessDeniedError,
    BenchmarkError,
    CheckpointClosedError,
    DeviceMemoryError,
    DeviceUnavailableError,
    EngineUnavailableError,
    FormatError,
    HeaderError,
    HostMemoryError,
    IncompleteSaveError,
    IntegrityError,
    InvalidOptionError,
    LayerInUseError,
    LoaderRegistrationError,
    ManifestError,
    MissingDependencyError,
    NotFound,
    OptionError,
    PeerError,
    SaveError,
    ShardIndexError,
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
from weightstream.options import LoadOptions
from weightstream.registry import available_loaders, register_loader

__version__ = "0.1.0"

_IMPORTED_ON_USE = {
    "DistributedStats": "weightstream.readers.distributed",
    "page_cache_residency": "weightstream.checkpoint.models",
    "resolve_model": "weightstream.checkpoint.models",
    "save_sharded_state": "weightstream.save.saver",
}
"""Names whose modules ``import weightstream`` leaves for their first use (they cost a third of its import time)."""


def __getattr__(name: str) -> object:
    if name not in _IMPORTED_ON_USE:
        raise AttributeError(f"module 'weightstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(_IMPORTED_ON_USE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_IMPORTED_ON_USE))


__all__ = [
    "AccessDeniedError",
    "BenchmarkError",
    "Checkpoint",
    "CheckpointClosedError",
    "CheckpointStats",
    "DeviceMemoryError",
    "DeviceUnavailableError",
    "DistributedStats",
    "EngineUnavailableError",
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
    "MissingDependencyError",
    "NotFound",
    "OptionError",
    "PeerError",
    "SaveError",
    "ShardIndexError",
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
