"""The manifest of one rank's sharded state: the commit marker a save writes last.

One JSON file per rank (``weightstream-manifest-rank-{r}.json``, or ``-pp-{p}-tp-{t}`` with
pipeline parallelism) naming the pattern, the rank, the world size, the checksum algorithm and,
per file, its size, its checksum (of the whole file: ``xxh128sum`` prints the same), the checksum
of its header and, per tensor, its offsets and checksum. A file's bytes are its header followed by
its tensors, so the header and tensor checksums cover every byte and can be checked in any order.

Example:
    >>> raw = encode_manifest(Manifest("model-rank-{rank}-part-{part}.safetensors", 0, 2, "xxh3-128", ()))
    >>> parse_manifest(raw, "m.json").world_size
    2
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any

from weightstream.errors import ManifestError
from weightstream.formats.sharded_state import Rank, ShardPattern
from weightstream.formats.strict_json import parse_json

MANIFEST_FORMAT = "weightstream.sharded-state"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20


def _xxh3_128() -> Any:
    import xxhash

    return xxhash.xxh3_128()


CHECKSUMS: dict[str, Callable[[], Any]] = {"xxh3-128": _xxh3_128, "sha256": hashlib.sha256}
"""Checksum algorithm -> a fresh hasher (``update(bytes)``, ``hexdigest()``). xxh3-128: about 16 GiB/s on one core
here."""


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    offset: int
    """Absolute byte offset in the file."""
    nbytes: int
    checksum: str


@dataclasses.dataclass(frozen=True)
class FileEntry:
    name: str
    """File name in the directory."""
    size: int
    checksum: str
    header_checksum: str
    """Of bytes ``[0, first tensor offset)``: the length prefix and the JSON header."""
    tensors: tuple[TensorEntry, ...]


@dataclasses.dataclass(frozen=True)
class Manifest:
    pattern: str
    rank: Rank
    world_size: Rank
    checksum: str
    files: tuple[FileEntry, ...]


MANIFEST_PREFIX = "weightstream-manifest-"
"""How every rank's manifest file name starts."""


def manifest_name(rank: Rank) -> str:
    """The manifest file of ``rank``.

    Example:
        >>> manifest_name(3), manifest_name((1, 0))
        ('weightstream-manifest-rank-3.json', 'weightstream-manifest-pp-1-tp-0.json')
    """
    return f"{MANIFEST_PREFIX}{_rank_label(rank)}.json"


def saving_marker_name(rank: Rank) -> str:
    """The marker a save of ``rank`` holds while it replaces files: a loader refuses the rank while it exists."""
    return f".weightstream-saving-{_rank_label(rank)}"


def _rank_label(rank: Rank) -> str:
    return f"pp-{rank[0]}-tp-{rank[1]}" if isinstance(rank, tuple) else f"rank-{rank}"


def new_hasher(algorithm: str) -> Any:
    """A fresh hasher for ``algorithm`` (one of :data:`CHECKSUMS`)."""
    return CHECKSUMS[algorithm]()


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest as UTF-8 JSON."""
    document = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "pattern": manifest.pattern,
        "rank": list(manifest.rank) if isinstance(manifest.rank, tuple) else manifest.rank,
        "world_size": list(manifest.world_size) if isinstance(manifest.world_size, tuple) else manifest.world_size,
        "checksum": manifest.checksum,
        "files": [
            {
                "name": entry.name,
                "size": entry.size,
                "checksum": entry.checksum,
                "header_checksum": entry.header_checksum,
                "tensors": [
                    {"name": t.name, "offset": t.offset, "nbytes": t.nbytes, "checksum": t.checksum}
                    for t in entry.tensors
                ],
            }
            for entry in manifest.files
        ],
    }
    return json.dumps(document, indent=1).encode("utf-8")


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """A validated manifest from ``raw``; ``ManifestError`` (naming ``where`` and the field) otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ManifestError(f"{where}: not UTF-8 ({error.reason} at byte {error.start})") from None
    document = parse_json(text, ManifestError, where)
    check = _Checker(where)
    check.keys(document, {"format", "version", "pattern", "rank", "world_size", "checksum", "files"}, "the manifest")
    if document["format"] != MANIFEST_FORMAT or document["version"] != MANIFEST_VERSION:
        raise ManifestError(
            f"{where}: format {document['format']!r} version {document['version']!r}; this weightstream reads "
            f"{MANIFEST_FORMAT!r} version {MANIFEST_VERSION}"
        )
    try:
        pattern = ShardPattern(document["pattern"])
    except ValueError as error:
        raise ManifestError(f"{where}: {error}") from None
    rank = check.rank(document["rank"], "rank")
    world_size = check.rank(document["world_size"], "world_size")
    try:
        pattern.check_rank(rank)
        pattern.check_rank(world_size, "world_size")
    except ValueError as error:
        raise ManifestError(f"{where}: {error}") from None
    if document["checksum"] not in CHECKSUMS:
        raise ManifestError(f"{where}: checksum {document['checksum']!r} is not one of {', '.join(CHECKSUMS)}")
    files = []
    for number, entry in enumerate(check.list(document["files"], "files")):
        at = f"files[{number}]"
        check.keys(entry, {"name", "size", "checksum", "header_checksum", "tensors"}, at)
        tensors = []
        for index, tensor in enumerate(check.list(entry["tensors"], f"{at}.tensors")):
            where_tensor = f"{at}.tensors[{index}]"
            check.keys(tensor, {"name", "offset", "nbytes", "checksum"}, where_tensor)
            tensors.append(
                TensorEntry(
                    check.text(tensor["name"], f"{where_tensor}.name"),
                    check.count(tensor["offset"], f"{where_tensor}.offset"),
                    check.count(tensor["nbytes"], f"{where_tensor}.nbytes"),
                    check.text(tensor["checksum"], f"{where_tensor}.checksum"),
                )
            )
        name = check.text(entry["name"], f"{at}.name")
        if pattern.parse(name) != (rank, number):
            raise ManifestError(
                f"{where}: {at} is {name!r}, but part {number} of {rank!r} is {pattern.name(rank, number)!r}"
            )
        files.append(
            FileEntry(
                name,
                check.count(entry["size"], f"{at}.size"),
                check.text(entry["checksum"], f"{at}.checksum"),
                check.text(entry["header_checksum"], f"{at}.header_checksum"),
                tuple(tensors),
            )
        )
    return Manifest(pattern.pattern, rank, world_size, document["checksum"], tuple(files))


class _Checker:
    """Field checks that name the manifest and the field in their errors."""

    def __init__(self, where: str) -> None:
        self.where = where

    def keys(self, value: object, expected: set[str], what: str) -> None:
        if not isinstance(value, dict):
            raise ManifestError(f"{self.where}: {what} must be an object, got {type(value).__name__}")
        if set(value) != expected:
            missing, extra = sorted(expected - set(value)), sorted(set(value) - expected)
            raise ManifestError(
                f"{self.where}: {what} " + (f"lacks {missing[0]!r}" if missing else f"has the unknown key {extra[0]!r}")
            )

    def list(self, value: object, what: str) -> list:
        if not isinstance(value, list):
            raise ManifestError(f"{self.where}: {what} must be a list, got {type(value).__name__}")
        return value

    def text(self, value: object, what: str) -> str:
        if not isinstance(value, str) or not value:
            raise ManifestError(f"{self.where}: {what} must be a non-empty string, got {value!r}")
        return value

    def count(self, value: object, what: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ManifestError(f"{self.where}: {what} must be a non-negative integer, got {value!r}")
        return value

    def rank(self, value: object, what: str) -> Rank:
        if isinstance(value, list) and len(value) == 2:
            return (self.count(value[0], what), self.count(value[1], what))
        return self.count(value, what)
