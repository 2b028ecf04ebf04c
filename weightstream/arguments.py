"""The command line's argument types: sizes (``1GiB``, ``512MiB``, ``2Ti``), ranks (``N`` or ``PP,TP``), whole
numbers and storage options (``KEY=VALUE``), each an ``argparse`` type that answers a bad value with a usage error
naming it; and the storage options' flags, which every command reading a checkpoint takes."""

from __future__ import annotations

import argparse
import decimal
import json
import re

from weightstream.errors import InvalidOptionError

MAX_SIZE = 1 << 62
SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def positive(text: str) -> int:
    """A whole number of 1 or more."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a whole number of 1 or more: {text[:40]!r}")
    return int(text)


def parse_rank(text: str) -> int | tuple[int, int]:
    """A rank or world size: ``N``, or ``PP,TP`` for a pipeline-parallel sharded state.

    Example:
        >>> parse_rank("1"), parse_rank("0,3")
        (1, (0, 3))
    """
    parts = text.split(",")
    if len(parts) > 2 or not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"not a rank: {text[:40]!r} (N, or PP,TP with pipeline parallelism)")
    numbers = [int(part) for part in parts]
    return numbers[0] if len(numbers) == 1 else (numbers[0], numbers[1])


def parse_size(text: str) -> int:
    """``"1GiB"`` -> 1073741824: decimal (``k``, ``M``, ``G``, ``T``, with or without ``B``) and binary units (``KiB``
    ... ``TiB``, and Kubernetes' ``Ki`` ... ``Ti``), at most 2**62 bytes.

    Example:
        >>> parse_size("512MiB"), parse_size("2Gi"), parse_size("1T")
        (536870912, 2147483648, 1000000000000)
    """
    match = re.fullmatch(r"\s*(\d{1,20}(?:\.\d{1,9})?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text[:40]!r} (examples: 1GiB, 512MiB, 4G, 2Ti)")
    size = int(decimal.Decimal(match.group(1)) * SIZE_UNITS[match.group(2).lower()])
    if size > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"too large a size: {text[:40]!r} (at most {MAX_SIZE >> 60} EiB)")
    return size


def storage_option(text: str) -> tuple[str, object]:
    """``KEY=VALUE``, the value read as JSON where it is JSON (``true``, ``3``, ``{"a": 1}``, ``"123"``), else text.

    Example:
        >>> storage_option("anon=true"), storage_option("endpoint_url=http://127.0.0.1:8333")
        (('anon', True), ('endpoint_url', 'http://127.0.0.1:8333'))
    """
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(f"not KEY=VALUE: {text[:60]!r}")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


def add_storage_arguments(command: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable) and ``--storage-options-file JSON``."""
    command.add_argument(
        "--storage-option",
        action="append",
        default=[],
        type=storage_option,
        metavar="KEY=VALUE",
        help="a setting of the source (endpoint_url=..., anon=true, region=...); VALUE is read as JSON where it "
        "is JSON, else as text; repeatable",
    )
    command.add_argument(
        "--storage-options-file", default=None, metavar="JSON", help="storage options from a JSON object in a file"
    )


def storage_options(pairs: list[tuple[str, object]], path: str | None) -> dict[str, object]:
    """The object in the JSON file at ``path`` (if any) updated by ``pairs`` (``--storage-option``'s).

    Raises:
        InvalidOptionError: the file cannot be read, is no JSON, or holds no object.
    """
    options: dict[str, object] = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as file:
                loaded = json.load(file)
        except (OSError, ValueError) as error:
            raise InvalidOptionError(f"--storage-options-file {path}: {error}") from None
        if not isinstance(loaded, dict):
            raise InvalidOptionError(
                f"--storage-options-file {path}: holds a JSON {type(loaded).__name__}, not an object of settings"
            )
        options.update(loaded)
    options.update(dict(pairs))
    return options
