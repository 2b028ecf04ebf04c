"""Cold and warm page-cache control used by the benchmarks."""

from __future__ import annotations

import os
from pathlib import Path

from weightstream.sources.local.pagecache import drop, resident_fraction, warm


def test_drop_then_warm(tmp_path: Path):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(8 << 20))
    warm(str(path))
    assert resident_fraction(str(path)) == 1.0
    drop(str(path))
    assert resident_fraction(str(path)) < 0.02
    warm(str(path))
    assert resident_fraction(str(path)) == 1.0
