"""The API's words in the command line's: an error raised by the library names ``chunk_bytes=`` or
``format='streaming'``; the person who typed ``--chunk-mib`` or ``--format streaming`` reads those back."""

from __future__ import annotations

import re

FLAGS = {
    "chunk_bytes": "--chunk-mib",
    "max_inflight_bytes": "--max-inflight-mib",
    "prefetch_layers": "--prefetch-layers",
    "pin_memory": "--pin-memory",
    "huge_pages": "--no-huge-pages",
    "storage_options": "--storage-option",
    "world_size": "--world-size",
}
"""Option names of the API -> the flag that sets each (names without an underscore are left alone: ``threads`` or
``filter`` are words of ordinary sentences too, and their flags check their own values)."""

_BOUNDARY_BEFORE = r"(?<![\w/.-])"
_BOUNDARY_AFTER = r"(?![\w/.-])"
_ASSIGNMENT = re.compile(_BOUNDARY_BEFORE + r"(format|device|pin_memory)=(?:'([^'\s]*)'|(True))")
_BYTES = re.compile(_BOUNDARY_BEFORE + r"(chunk_bytes|max_inflight_bytes)=(\d+)(?: \([^)]*MiB\))?")
"""A size the API names in bytes, whose flag takes MiB (the bytes' own rendering in MiB after it, dropped)."""
_OPTION_OF = re.compile(_BOUNDARY_BEFORE + r"([a-z_]+)(?=: an option of )")
_NAME = re.compile(_BOUNDARY_BEFORE + "(" + "|".join(FLAGS) + ")" + _BOUNDARY_AFTER)


def in_flags(message: str) -> str:
    """``message`` with the API's option spellings replaced by the command line's flags.

    Example:
        >>> in_flags("max_inflight_bytes: an option of format='streaming'; pass device='cpu' or pin_memory=True")
        '--max-inflight-mib: an option of --format streaming; pass --device cpu or --pin-memory'
        >>> in_flags("rank: an option of format='sharded-state'")
        '--rank: an option of --format sharded-state'
        >>> in_flags("max_inflight_bytes=67108864 (64 MiB) cannot hold tensor 'x'")
        "--max-inflight-mib 64 cannot hold tensor 'x'"
    """

    def assignment(match: re.Match[str]) -> str:
        name, value, true = match.groups()
        flag = FLAGS.get(name, f"--{name}")
        return flag if true else f"{flag} {value}"

    message = _BYTES.sub(lambda match: f"{FLAGS[match.group(1)]} {int(match.group(2)) / 2**20:g}", message)
    message = _OPTION_OF.sub(lambda match: FLAGS.get(match.group(1), "--" + match.group(1).replace("_", "-")), message)
    return _NAME.sub(lambda match: FLAGS[match.group(1)], _ASSIGNMENT.sub(assignment, message))
