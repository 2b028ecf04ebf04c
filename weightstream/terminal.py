"""Text for a terminal: what the package prints of names a file or a server chose."""

from __future__ import annotations

import unicodedata

UNPRINTABLE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})
"""Unicode categories never written raw: controls, format characters, separators, surrogates, private use."""


def printable(text: str) -> str:
    """``text`` safe for a terminal: control and format characters (ANSI escapes, bidirectional
    overrides, line separators) written as escapes, so a hostile header cannot drive the terminal.

    Example:
        >>> printable("model.\\x1b[2Jlayers")
        'model.\\\\x1b[2Jlayers'
    """
    return "".join(
        character if unicodedata.category(character) not in UNPRINTABLE else _escape(character) for character in text
    )


def _escape(character: str) -> str:
    code = ord(character)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
