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
    FormatError,
    HeaderError,
    HostMemoryError,
    InvalidOptionError,
    LayerInUseError,
    LoaderRegistrationError,
    NotFound,
    OptionError,
    ShardIndexError,
    SourceChangedError,
    SourceError,
    SourceTimeout,
    TensorNotFound,
    TruncatedFileError,
    UnknownFormatError,
    UnsupportedInputError,
    WeightstreamError,
)
from weightstream.options import LoadOptions
from weightstream.registry import available_loaders, register_loader

__version__ = "0.1.0"

__all__ = [
    "BenchmarkError",
    "DeviceMemoryError",
    "DeviceUnavailableError",
    "FormatError",
    "HeaderError",
    "HostMemoryError",
    "InvalidOptionError",
    "LayerInUseError",
    "LoadOptions",
    "LoaderRegistrationError",
    "NotFound",
    "OptionError",
    "ShardIndexError",
    "SourceChangedError",
    "SourceError",
    "SourceTimeout",
    "TensorNotFound",
    "TruncatedFileError",
    "UnknownFormatError",
    "UnsupportedInputError",
    "WeightstreamError",
    "available_loaders",
    "iter_layers",
    "iter_weights",
    "load_weights",
    "plan_load",
    "register_loader",
    "resolve_format",
]
