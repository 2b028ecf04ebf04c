"""The safetensors format: a strict header parser.

Layout: 8 bytes little-endian header length N, N bytes of UTF-8 JSON (a single object,
optionally padded with JSON whitespace), then the data section. Every rule of the specification
is checked here, before any buffer is sized from the header's numbers.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping
from typing import Any

import torch

from weightstream.errors import HeaderError, TruncatedFileError
from weightstream.formats.strict_json import parse_json

LENGTH_BYTES = 8
JSON_WHITESPACE = " \t\n\r"
"""What may pad the header's object, before or after it: JSON's own whitespace, which safetensors' parser (serde_json)
skips. The specification asks writers to start with ``{`` and pad with spaces; readers accept all four."""
MAX_HEADER_BYTES = 100_000_000
"""The reference implementation's limit on the JSON header."""
METADATA_KEY = "__metadata__"
MAX_ELEMENTS = 2**63 - 1
MAX_DIMENSIONS = 64
"""No real tensor has more; a hostile shape list of 400,000 dimensions is refused before it is multiplied."""
ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})

DTYPES: Mapping[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "F32": torch.float32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
}
"""safetensors dtype names and the torch dtypes they load as."""

PACKED_PAIRS = frozenset({"F4"})
"""Dtypes stored two per byte: the header's last dimension counts values, torch's counts pairs."""

DTYPE_NAMES: Mapping[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


@dataclasses.dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor as a header declares it; offsets are relative to the data section."""

    name: str
    dtype_name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    """The shape of the torch tensor (for packed dtypes, the last dimension in pairs)."""
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class Header:
    """A validated safetensors header."""

    entries: tuple[HeaderEntry, ...]
    """In the header's own order."""
    metadata: Mapping[str, str]
    data_offset: int
    """Absolute offset of the data section: 8 + header length."""


def header_length(prefix: bytes, file_size: int, file: str) -> int:
    """Validate the 8-byte length prefix and return the header length.

    Example:
        >>> header_length((2).to_bytes(8, "little"), 10, "f.safetensors")
        2
    """
    if file_size < LENGTH_BYTES or len(prefix) < LENGTH_BYTES:
        raise HeaderError(f"{file}: file is {file_size} bytes, shorter than the {LENGTH_BYTES}-byte header length")
    (length,) = struct.unpack("<Q", prefix[:LENGTH_BYTES])
    if length > MAX_HEADER_BYTES:
        raise HeaderError(
            f"{file}: header length {length} exceeds the limit of {MAX_HEADER_BYTES} bytes{looks_like(prefix)}"
        )
    if LENGTH_BYTES + length > file_size:
        raise HeaderError(
            f"{file}: header length {length} runs past the end of the file "
            f"(header would end at byte {LENGTH_BYTES + length}, file has {file_size} bytes){looks_like(prefix)}"
        )
    return length


FILE_SIGNATURES = (
    (b"PK\x03\x04", "a zip archive (torch.save's format: pickled objects, which weightstream never loads)"),
    (b"\x80", "a pickle (weightstream never unpickles anything)"),
    (b"GGUF", "a GGUF file"),
    (b"\x89HDF", "an HDF5 file"),
    (b"\x1f\x8b", "a gzip archive"),
)
"""The first bytes of files that are mistaken for checkpoints, and what they are."""


def looks_like(prefix: bytes) -> str:
    """What a file whose first bytes are ``prefix`` seems to be, for the message of a header that is none, or "".

    Example:
        >>> looks_like(b'{"architectures": ["LlamaForCausalLM"]}')
        '; the file starts like JSON text, not a safetensors file (a config or an index?)'
        >>> looks_like((100).to_bytes(8, "little"))
        ''
    """
    for signature, what in FILE_SIGNATURES:
        if prefix.startswith(signature):
            return f"; the file looks like {what}, not a safetensors file"
    if prefix.lstrip()[:1] in (b"{", b"["):
        return "; the file starts like JSON text, not a safetensors file (a config or an index?)"
    if prefix and all(32 <= byte < 127 or byte in b"\t\r\n" for byte in prefix[:LENGTH_BYTES]):
        return "; the file starts like text, not a safetensors file"
    return ""


def parse_header(raw: bytes, file_size: int, file: str) -> Header:
    """Parse and validate header bytes (those after the 8-byte length) of a file of ``file_size`` bytes.

    Raises:
        HeaderError: any rule of the specification is broken.
        TruncatedFileError: the tensors extend past the end of the file.

    Example:
        >>> raw = b'{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
        >>> parse_header(raw, 8 + len(raw) + 2, "f").entries[0].shape
        (2,)
    """
    document = _decode(raw, file)
    metadata = _metadata(document.pop(METADATA_KEY, {}), file)
    entries = tuple(
        _entry(name, document.pop(name), file) for name in list(document)
    )  # each entry's JSON freed as it is read
    data_offset = LENGTH_BYTES + len(raw)
    _check_coverage(entries, file_size - data_offset, data_offset, file)
    return Header(entries=entries, metadata=metadata, data_offset=data_offset)


def _decode(raw: bytes, file: str) -> dict[str, Any]:
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise HeaderError(
            f"{file}: header contains a NUL byte at file offset {LENGTH_BYTES + nul} (padding must be JSON "
            "whitespace: spaces, tabs, CR or LF)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise HeaderError(f"{file}: header is not valid UTF-8 at header byte {error.start}") from None
    body = text.lstrip(JSON_WHITESPACE)
    if body.startswith("["):
        raise HeaderError(f"{file}: header is a JSON array, expected a JSON object")
    if not body.startswith("{"):
        found = f"starts with {body[:1]!r}" if body else "holds nothing"
        after = f" after {len(text) - len(body)} bytes of whitespace" if len(body) < len(text) else ""
        raise HeaderError(f"{file}: header {found}{after}, expected a JSON object starting with '{{'")
    document = parse_json(text, HeaderError, f"{file}: header")
    return document


def _metadata(value: object, file: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise HeaderError(f"{file}: {METADATA_KEY} is {type(value).__name__}, expected an object of strings")
    for key, item in value.items():
        if not isinstance(item, str):
            raise HeaderError(f"{file}: {METADATA_KEY}[{key!r}] is {type(item).__name__} {item!r}, expected a string")
    return value


def _entry(name: str, value: object, file: str) -> HeaderEntry:
    where = f"tensor {name!r} in {file}"
    if not isinstance(value, dict):
        raise HeaderError(
            f"{where}: entry is {type(value).__name__}, expected an object with dtype, shape, data_offsets"
        )
    if set(value) != ENTRY_KEYS:
        missing, extra = sorted(ENTRY_KEYS - set(value)), sorted(set(value) - ENTRY_KEYS)
        raise HeaderError(f"{where}: entry keys missing {missing}, unexpected {extra}")
    dtype_name, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise HeaderError(f"{where}: unknown dtype {dtype_name!r}; known: {', '.join(DTYPES)}")
    if isinstance(shape, list) and len(shape) > MAX_DIMENSIONS:
        raise HeaderError(
            f"{where}: shape has {len(shape)} dimensions, more than the {MAX_DIMENSIONS} weightstream accepts"
        )
    if not _non_negative_ints(shape):
        raise HeaderError(
            f"{where}: shape {_shown(shape) if isinstance(shape, list) else repr(shape)[:200]} is not a list of "
            "non-negative integers"
        )
    if not (_non_negative_ints(offsets) and len(offsets) == 2):
        raise HeaderError(f"{where}: data_offsets {offsets!r} is not a pair of non-negative integers")
    begin, end = offsets
    if begin > end:
        raise HeaderError(f"{where}: data_offsets [{begin}, {end}] begin after they end")
    elements = 1
    for dimension in shape:
        elements *= dimension
        if elements > MAX_ELEMENTS:
            raise HeaderError(
                f"{where}: shape {_shown(shape)} has more than 2**63 - 1 elements, more than fit in 64 bits"
            )
    expected = _nbytes(dtype_name, shape, elements, where)
    if end - begin != expected:
        raise HeaderError(
            f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
            f"expected {expected} for {dtype_name} {_shown(shape)}"
        )
    torch_shape = tuple(shape[:-1]) + (shape[-1] // 2,) if dtype_name in PACKED_PAIRS else tuple(shape)
    return HeaderEntry(name, dtype_name, DTYPES[dtype_name], torch_shape, begin, end)


def _nbytes(dtype_name: str, shape: list[int], elements: int, where: str) -> int:
    if dtype_name in PACKED_PAIRS:
        if not shape or shape[-1] % 2:
            raise HeaderError(
                f"{where}: {dtype_name} packs two values per byte; the last dimension of {_shown(shape)} must be even"
            )
        return elements // 2
    return elements * DTYPES[dtype_name].itemsize


def _check_coverage(entries: tuple[HeaderEntry, ...], data_bytes: int, data_offset: int, file: str) -> None:
    """Offsets must tile the data section exactly: from 0, no gap, no overlap, nothing after."""
    reached = 0
    previous = None
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        first, end = data_offset + entry.begin, data_offset + entry.end
        span = f"data_offsets [{entry.begin}, {entry.end}] (file bytes {first}..{end})"
        if entry.begin < reached:
            raise HeaderError(
                f"tensor {entry.name!r} in {file}: {span} overlap the previous tensor {previous!r}, which ends at "
                f"{reached}"
            )
        if entry.begin > reached:
            after = f"after tensor {previous!r}" if previous is not None else "at the start of the data"
            raise HeaderError(
                f"tensor {entry.name!r} in {file}: {span} leave a gap of {entry.begin - reached} bytes {after} "
                f"(expected begin {reached})"
            )
        if entry.end > data_bytes:
            raise TruncatedFileError(
                f"tensor {entry.name!r} in {file}: {span} end past the end of the file "
                f"(data section has {data_bytes} bytes, file has {data_offset + data_bytes})"
            )
        reached, previous = entry.end, entry.name
    if reached < data_bytes:
        raise HeaderError(
            f"{file}: {data_bytes - reached} trailing bytes after the last tensor "
            f"(tensors end at file byte {data_offset + reached}, file has {data_offset + data_bytes} bytes)"
        )


def _shown(shape: list[int]) -> str:
    """A shape for a message, shortened: a hostile header's shape may have a million dimensions."""
    return str(shape) if len(shape) <= 8 else f"[{', '.join(map(str, shape[:8]))}, ... ({len(shape)} dimensions)]"


def _non_negative_ints(value: object) -> bool:
    """Whether ``value`` is a list of non-negative integers (JSON's: ``int``, never ``bool``)."""
    return isinstance(value, list) and set(map(type, value)) <= {int} and min(value, default=0) >= 0
