"""The Hugging Face sharded layout: ``model.safetensors.index.json``.

The index maps each tensor name to the shard file holding it. Shard names must stay
inside the checkpoint directory: relative, no ``..``, no scheme.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Mapping
from typing import Any

from weightstream.errors import ShardIndexError
from weightstream.formats.strict_json import parse_json

INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = 256 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ShardIndex:
    """A validated index: tensor name -> shard file name (relative to the directory)."""

    weight_map: Mapping[str, str]
    metadata: Mapping[str, Any]

    @property
    def shards(self) -> tuple[str, ...]:
        """Shard names in first-mention order, each once."""
        return tuple(dict.fromkeys(self.weight_map.values()))


def parse_index(raw: bytes, file: str) -> ShardIndex:
    """Parse and validate the bytes of an index file.

    Raises:
        ShardIndexError: not a JSON object with a ``weight_map`` of string -> safe relative name,
            or a tensor listed twice.

    Example:
        >>> parse_index(b'{"weight_map": {"w": "a.safetensors"}}', "index.json").shards
        ('a.safetensors',)
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ShardIndexError(f"{file}: not valid UTF-8 at byte {error.start}") from None
    document = parse_json(text, ShardIndexError, file)
    if not isinstance(document, dict):
        raise ShardIndexError(f"{file}: top level is {type(document).__name__}, expected a JSON object")
    weight_map = document.get("weight_map")
    if not isinstance(weight_map, dict):
        raise ShardIndexError(
            f"{file}: 'weight_map' is {type(weight_map).__name__}, expected an object of tensor name -> shard file"
        )
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ShardIndexError(f"{file}: weight_map[{name!r}] is {type(shard).__name__}, expected a shard file name")
        check_shard_name(shard, f"{file}: weight_map[{name!r}]")
    metadata = document.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ShardIndexError(f"{file}: 'metadata' is {type(metadata).__name__}, expected an object")
    return ShardIndex(weight_map=weight_map, metadata=metadata)


def check_shard_name(shard: str, where: str) -> None:
    """Refuse shard names that could leave the checkpoint directory (absolute, ``..``, URLs), as written
    or once percent-decoded (a web server decodes ``%2e%2e%2f`` into ``../``), and query strings.

    Example:
        >>> check_shard_name("%2e%2e/secret.safetensors", "index")
        Traceback (most recent call last):
        ...
        weightstream.errors.ShardIndexError: index: shard name '%2e%2e/secret.safetensors' is not a plain relative ...
    """
    for form in (shard, urllib.parse.unquote(shard)):
        parts = form.replace("\\", "/").split("/")
        if (
            not form
            or parts[0] == ""
            or ":" in form
            or "\x00" in form
            or "?" in form
            or "#" in form
            or ".." in parts
            or "." in parts
        ):
            raise ShardIndexError(
                f"{where}: shard name {shard!r} is not a plain relative path inside the checkpoint directory"
            )
