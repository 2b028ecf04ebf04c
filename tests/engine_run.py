"""What the engine scripts (``tests/vllm_generate.py``, ``tests/sglang_check.py``) share, in the engine's
interpreter."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path


class Said(logging.Handler):
    """What weightstream's engine adapters log, kept."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def adapters_said() -> Iterator[list[str]]:
    """Within: the messages the adapters (``weightstream.engines``) log, at INFO and above."""
    said = Said()
    adapters = logging.getLogger("weightstream.engines")
    adapters.setLevel(logging.INFO)
    adapters.addHandler(said)
    try:
        yield said.messages
    finally:
        adapters.removeHandler(said)


def make_cold(model: str) -> None:
    """Drop the model's safetensors files from the page cache."""
    from weightstream.sources.local.pagecache import drop

    for path in Path(model).glob("*.safetensors"):
        drop(str(path))
