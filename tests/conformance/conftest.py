"""The conformance suite's one parameter: every registered loader with each layout its writers make."""

from __future__ import annotations

from pathlib import Path

import pytest

import weightstream
from tests.conformance.writers import WRITERS, running

CASES = [(name, writer) for name in weightstream.available_loaders() for writer in WRITERS.get(name, [None])]


@pytest.fixture(params=CASES, ids=[f"{name}-{writer.__name__ if writer else 'no-writer'}" for name, writer in CASES])
def layout(request, tmp_path: Path):
    """``(loader name, writer)``, with what the loader needs around it (a process group for ``distributed``)."""
    name, writer = request.param
    assert writer is not None, f"loader {name!r} is registered but tests/conformance/writers.py has no writer for it"
    with running(name, tmp_path):
        yield name, writer
