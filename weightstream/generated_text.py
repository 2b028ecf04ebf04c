"""Text a program generates inside a document (the options and errors tables, the figures), between two marker
lines the document keeps."""

from __future__ import annotations

import re
from pathlib import Path


def replace_between(document: Path, begin: str, end: str, generated: str) -> bool:
    """Put ``generated`` (which starts with ``begin`` and ends with ``end``) in place of the text from ``begin`` to
    ``end`` in ``document``; whether it changed.

    Raises:
        SystemExit: the document has no such markers (said with both).

    Example:
        >>> replace_between(Path("docs/api.md"), "<!-- a -->", "<!-- b -->", "")  # doctest: +SKIP
    """
    text = document.read_text()
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{document}: no markers {begin!r} ... {end!r}")
    updated = pattern.sub(lambda _: generated, text)
    if updated != text:
        document.write_text(updated)
    return updated != text
