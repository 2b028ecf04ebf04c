"""Reading a safetensors header through a :class:`Source`: the I/O around the pure parser
(``weightstream.formats.safetensors``), within a parse budget the caller gives or a plan makes.

Example:
    >>> from weightstream.sources.local.file import LocalFile
    >>> with LocalFile(path) as source:  # doctest: +SKIP
    ...     header = read_header(source, ParseBudget())
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from weightstream.errors import HeaderError
from weightstream.formats.safetensors import LENGTH_BYTES, Header, header_length, parse_header
from weightstream.sources.base import Source

HEADER_PROBE_BYTES = 64 * 1024
"""Headers of real checkpoints are tens of KiB: one read usually gets the length and the JSON."""
PARSE_BUDGET_BYTES = 64 << 20
"""Header bytes one plan parses at once, by default. While it is parsed a header holds about ten times its size
in Python objects (measured: 10x for one of zero-size tensors), so a hostile 100 MB header peaks near 1 GB, and the
eight a plan reads at once would multiply that; past this budget a header waits for the others, and one larger
than it is parsed alone. Real headers (tens of KiB) never wait."""


class ParseBudget:
    """Admits header bytes to be parsed while the bytes in parse stay within ``limit`` (a header larger than
    ``limit`` is admitted alone). One per plan, shared by the threads that read its headers.

    Example:
        >>> budget = ParseBudget(1 << 20)
        >>> with budget.admit(4096):
        ...     budget.in_use
        4096
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = PARSE_BUDGET_BYTES if limit is None else limit
        """At most this many header bytes in parse at once (default :data:`PARSE_BUDGET_BYTES`)."""
        self.in_use = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def admit(self, nbytes: int) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: self.in_use == 0 or self.in_use + nbytes <= self.limit)
            self.in_use += nbytes
        try:
            yield
        finally:
            with self._changed:
                self.in_use -= nbytes
                self._changed.notify_all()


def read_header(source: Source, budget: ParseBudget) -> Header:
    """Read and validate the header of an open safetensors source, parsed within ``budget``.

    Raises:
        HeaderError, TruncatedFileError: the header is malformed, or longer than the file.
    """
    size = source.size
    if size < LENGTH_BYTES:
        raise HeaderError(f"{source.uri}: file is {size} bytes, shorter than the {LENGTH_BYTES}-byte header length")
    probe = source.read(0, min(size, HEADER_PROBE_BYTES))
    length = header_length(probe, size, source.uri)
    end = LENGTH_BYTES + length
    with budget.admit(length):
        raw = (
            probe[LENGTH_BYTES:end]
            if end <= len(probe)
            else probe[LENGTH_BYTES:] + source.read(len(probe), end - len(probe))
        )
        del probe
        return parse_header(raw, size, source.uri)
