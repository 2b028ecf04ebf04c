"""JSON as checkpoints need it: duplicate keys, NaN/Infinity and runaway nesting are errors."""

from __future__ import annotations

import json
import re
from typing import Any

from weightstream.errors import FormatError

SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""Where a lone surrogate could come from: text decoded from UTF-8 holds none, only a ``\\uD800``-``\\uDFFF``
escape makes one (an escaped backslash before ``ud8..`` matches too, and only costs the full check)."""


def parse_json(text: str, error: type[FormatError], where: str) -> Any:
    """``json.loads`` that raises ``error`` (naming ``where``) instead of accepting ambiguous JSON, or
    strings that are not Unicode text (a ``\\ud800`` escape decodes to a lone surrogate, which no
    UTF-8 output can hold: safetensors' own parser refuses it).

    Example:
        >>> parse_json('{"a": 1}', FormatError, "f")
        {'a': 1}
        >>> parse_json('{"a": 1, "a": 2}', FormatError, "f")
        Traceback (most recent call last):
        ...
        weightstream.errors.FormatError: f has the key 'a' twice
    """

    check_text = SURROGATE_ESCAPE.search(text) is not None

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result = dict(pairs)
        if len(result) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    raise error(f"{where} has the key {key!r} twice")
                seen.add(key)
        if check_text:
            for key, value in pairs:
                _check_text(key, error, where)
                if isinstance(value, (str, list)):
                    _check_text(value, error, where)
        return result

    def reject(constant: str) -> None:
        raise error(f"{where} contains the non-JSON constant {constant}")

    try:
        document = json.loads(text, object_pairs_hook=unique, parse_constant=reject)
        if check_text and isinstance(document, (str, list)):
            _check_text(document, error, where)
        return document
    except FormatError:
        raise
    except json.JSONDecodeError as decode_error:
        raise error(f"{where} is not valid JSON: {decode_error.msg} at byte {decode_error.pos}") from None
    except (ValueError, RecursionError) as other:
        # Integers longer than Python's digit limit, or nesting deeper than the recursion limit.
        raise error(f"{where} is not acceptable JSON: {other}") from None


def _check_text(value: Any, error: type[FormatError], where: str) -> None:
    """Refuse lone surrogates in ``value`` (a string, or the strings of a list, at any depth; objects
    are checked as they are built)."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as bad:
                raise error(
                    f"{where} holds a string with a lone surrogate (U+{ord(value[bad.start]):04X}) at character "
                    f"{bad.start}: "
                    f"not valid Unicode text"
                ) from None
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (str, list)):
                _check_text(item, error, where)
