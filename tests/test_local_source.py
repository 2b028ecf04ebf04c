"""The local source: direct-read decisions and the filesystem refusing O_DIRECT."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest

from weightstream.errors import SourceError, TruncatedFileError
from weightstream.sources.local import file as local
from weightstream.sources.local import pagecache
from weightstream.sources.local.file import LocalFile, LocalStore


@pytest.fixture
def cold_file(tmp_path: Path) -> str:
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(1 << 20))
    pagecache.drop(str(path))
    return str(path)


def test_filesystem_refusing_o_direct(cold_file, monkeypatch):
    """Some filesystems answer EINVAL to O_DIRECT; "auto" reads through the page cache, True raises."""
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(local.os, "open", refuse_direct)
    with LocalStore().open(cold_file, direct="auto") as source:
        assert not source.direct
        assert source.read(0, 16) == Path(cold_file).read_bytes()[:16]
    with pytest.raises(SourceError, match=rf"{cold_file}: cannot open with O_DIRECT: Invalid argument"):
        LocalStore().open(cold_file, direct=True)


def test_direct_read_past_the_end_stops_at_the_end(cold_file):
    data = Path(cold_file).read_bytes()
    pagecache.drop(cold_file)
    buffer = mmap.mmap(-1, 8192)  # page-aligned, as O_DIRECT requires
    with LocalFile(cold_file, direct=True) as source:
        source.read_into(len(data) - 4096, memoryview(buffer))  # the last page, plus one past the end
    assert buffer[:4096] == data[-4096:]
    assert buffer[4096:] == bytes(4096)


def test_file_shrunk_after_open(cold_file):
    with LocalFile(cold_file) as source:
        os.truncate(cold_file, 100)
        with pytest.raises(TruncatedFileError, match=rf"{cold_file}: file ends at byte 100, expected bytes up to 4096"):
            source.read_into(0, memoryview(bytearray(4096)))
