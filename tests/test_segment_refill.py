"""The segment store fills a fresh file from the origin where its filler reports that the file's memory may still be
written (a peer's transfer that could not be stopped): the segment holds the origin's bytes, the abandoned file is
gone, and nothing else is left in the cache directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.rangeserver import RangeServer
from weightstream.errors import MemoryStillInUseError
from weightstream.nodecache.daemon.segments import SegmentStore
from weightstream.sources import store_for


class StuckFiller:
    """A filler whose peer's transfer could not be released after it wrote part of the file."""

    def __init__(self) -> None:
        self.files: list[str] = []

    def fill(self, key, source, fd, threads, cancel, gpu=None) -> bool:
        self.files.append(os.readlink(f"/proc/self/fd/{fd}"))
        os.ftruncate(fd, source.size)
        os.pwrite(fd, b"\xee" * 4096, 0)
        raise MemoryStillInUseError("peer-a: the read of bytes 0..8388608 could not be stopped")

    def evicted(self, key: str) -> None:
        pytest.fail("a fill that never came from the fleet was withdrawn from it")


def test_a_fill_whose_memory_may_still_be_written_is_filled_again_into_a_fresh_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    data = os.urandom(3 << 20)
    (tmp_path / "origin").mkdir()
    (tmp_path / "origin" / "model.safetensors").write_bytes(data)
    cache = tmp_path / "cache"
    cache.mkdir()
    with RangeServer(tmp_path / "origin") as server:
        url = f"{server.url}/model.safetensors"
        store = store_for(url)
        source = store.open(url)
        try:
            filler = StuckFiller()
            segments = SegmentStore(str(cache), None)
            segment = segments.fill("k" * 32, source, threads=2, filler=filler)
        finally:
            source.close()
            store.close()
    assert Path(segments.path(segment.key)).read_bytes() == data
    assert len(filler.files) == 1 and not os.path.exists(filler.files[0].removesuffix(" (deleted)"))
    assert sorted(path.name for path in cache.iterdir() if path.name.startswith("tmp-")) == []
    assert "filled again from the origin, into a fresh file" in caplog.text
