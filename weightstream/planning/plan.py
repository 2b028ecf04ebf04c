"""What to read: tensor specs, and the coalesced read requests that fetch them.

Pure data and pure functions; no I/O. A loader turns a checkpoint's headers into a
:class:`LoadPlan`, then :func:`layout_file` places the wanted bytes of one file into
one destination buffer and splits them into large :class:`ReadRequest` s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

PAGE = 4096
"""Each run of bytes starts on a fresh destination page at the file offset's position within
its page, and the buffer ends on a page boundary: the file's own alignment carries over to
memory, and a direct (O_DIRECT) read may fill whole pages without touching another run."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint: where its bytes are and what they mean."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str
    """Path or URI of the file holding the bytes."""
    offset: int
    """Absolute byte offset of the first byte in ``file``."""
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclasses.dataclass(frozen=True)
class FileSpec:
    """One file of a checkpoint, as its header describes it."""

    path: str
    size: int
    data_offset: int
    """Where the data section starts (after the 8-byte length and the header)."""
    metadata: Mapping[str, str]
    version: str | None = None
    """The version the header was read from (an S3 ETag, a GCS generation, a local file's
    ``dev:inode:mtime_ns:ctime_ns``)."""


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """Everything a loader will read: the files and the selected tensors, in file order."""

    uri: str
    """The checkpoint as the caller named it."""
    files: tuple[FileSpec, ...]
    tensors: tuple[TensorSpec, ...]

    @property
    def total_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors)

    def tensors_of(self, path: str) -> list[TensorSpec]:
        """The selected tensors stored in ``path``, by offset."""
        return sorted((t for t in self.tensors if t.file == path), key=lambda t: (t.offset, t.nbytes))


@dataclasses.dataclass(frozen=True)
class ReadRequest:
    """One read: ``nbytes`` from ``offset`` of ``file`` into the buffer at ``dest_offset``."""

    file: str
    offset: int
    nbytes: int
    dest_offset: int


@dataclasses.dataclass(frozen=True)
class FileLayout:
    """Where one file's wanted bytes land in its destination buffer, and how they are read."""

    file: str
    buffer_bytes: int
    tensor_offsets: tuple[tuple[TensorSpec, int], ...]
    """Each tensor with its offset in the destination buffer."""
    requests: tuple[ReadRequest, ...]
    tensor_requests: tuple[tuple[int, ...], ...]
    """For each tensor (same order as ``tensor_offsets``), the indices of the requests it needs."""


def layout_file(tensors: Sequence[TensorSpec], chunk_bytes: int) -> FileLayout:
    """Coalesce the tensors of one file into runs of adjacent bytes and split them into reads.

    Only the tensors' own bytes are read: a run ends wherever the next tensor does not
    start exactly where the previous one ended. Runs are split at file offsets that are
    multiples of ``chunk_bytes``.

    Example:
        >>> spec = TensorSpec("w", torch.uint8, (10,), "f", 100, 10)
        >>> layout_file([spec], 4096).requests
        (ReadRequest(file='f', offset=100, nbytes=10, dest_offset=100),)
    """
    ordered = sorted(tensors, key=lambda t: (t.offset, t.nbytes))
    runs: list[tuple[int, int, int]] = []  # (file offset, nbytes, dest offset)
    dest_end = 0
    placed: list[tuple[TensorSpec, int]] = []
    for spec in ordered:
        if runs and runs[-1][0] + runs[-1][1] == spec.offset:
            start, size, dest = runs[-1]
            runs[-1] = (start, size + spec.nbytes, dest)
        else:
            dest = _align_like(dest_end, spec.offset)
            runs.append((spec.offset, spec.nbytes, dest))
        start, size, dest = runs[-1]
        placed.append((spec, dest + spec.offset - start))
        dest_end = dest + size
    requests = tuple(_split(ordered[0].file if ordered else "", runs, chunk_bytes))
    return FileLayout(
        file=ordered[0].file if ordered else "",
        buffer_bytes=round_up_to_page(dest_end),
        tensor_offsets=tuple(placed),
        requests=requests,
        tensor_requests=tuple(_requests_of(spec, requests) for spec, _ in placed),
    )


def _align_like(position: int, file_offset: int) -> int:
    """On the first page boundary at or after ``position``, at ``file_offset``'s offset within its page."""
    return round_up_to_page(position) + file_offset % PAGE


def round_up_to_page(position: int) -> int:
    """The first multiple of PAGE at or after ``position``."""
    return -(-position // PAGE) * PAGE


def _split(file: str, runs: list[tuple[int, int, int]], chunk_bytes: int) -> list[ReadRequest]:
    requests = []
    for start, size, dest in runs:
        offset, end = start, start + size
        while offset < end:
            stop = min(end, (offset // chunk_bytes + 1) * chunk_bytes)
            requests.append(ReadRequest(file, offset, stop - offset, dest + offset - start))
            offset = stop
    return requests


def _requests_of(spec: TensorSpec, requests: Sequence[ReadRequest]) -> tuple[int, ...]:
    if spec.nbytes == 0:
        return ()
    # Requests are sorted by offset and disjoint: binary search the first that ends after the start.
    low, high = 0, len(requests)
    while low < high:
        middle = (low + high) // 2
        if requests[middle].offset + requests[middle].nbytes <= spec.offset:
            low = middle + 1
        else:
            high = middle
    needed = []
    index = low
    while index < len(requests) and requests[index].offset < spec.end:
        needed.append(index)
        index += 1
    return tuple(needed)
