"""JSON as checkpoints need it: duplicate keys, NaN/Infinity and runaway nesting are errors."""

from __future__ import annotations

import json
from typing import Any

from weightstream.errors import FormatError


def parse_json(text: str, error: type[FormatError], where: str) -> Any:
    """``json.loads`` that raises ``error`` (naming ``where``) instead of accepting ambiguous JSON.

    Example:
        >>> parse_json('{"a": 1}', FormatError, "f")
        {'a': 1}
        >>> parse_json('{"a": 1, "a": 2}', FormatError, "f")
        Traceback (most recent call last):
        ...
        weightstream.errors.FormatError: f has the key 'a' twice
    """

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise error(f"{where} has the key {key!r} twice")
            result[key] = value
        return result

    def reject(constant: str) -> None:
        raise error(f"{where} contains the non-JSON constant {constant}")

    try:
        return json.loads(text, object_pairs_hook=unique, parse_constant=reject)
    except FormatError:
        raise
    except json.JSONDecodeError as decode_error:
        raise error(f"{where} is not valid JSON: {decode_error.msg} at byte {decode_error.pos}") from None
    except (ValueError, RecursionError) as other:
        # Integers longer than Python's digit limit, or nesting deeper than the recursion limit.
        raise error(f"{where} is not acceptable JSON: {other}") from None
