"""weightstream: LLM weights from storage into memory at the speed of the hardware.

Example:
    >>> import weightstream
    >>> weights = weightstream.load_weights("model/")  # doctest: +SKIP
"""

from weightstream.api import iter_layers, iter_weights, load_weights, plan_load, resolve_format
from weightstream.errors import (
    BenchmarkError,
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
from weightstream.readers.distributed import DistributedStats
from weightstream.registry import available_loaders, register_loader
from weightstream.save.saver import save_sharded_state

__version__ = "0.1.0"

__all__ = [
    "BenchmarkError",
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
    "TruncatedFileError",
    "UnknownFormatError",
    "UnsupportedInputError",
    "WeightsMismatchError",
    "WeightstreamError",
    "available_loaders",
    "iter_layers",
    "iter_weights",
    "load_weights",
    "plan_load",
    "register_loader",
    "resolve_format",
    "save_sharded_state",
]
