"""A local file mapped privately (copy-on-write), for loads that hand out views of the file itself."""

from __future__ import annotations

import os

import torch

from weightstream.errors import SourceChangedError, SourceError
from weightstream.sources.local.identity import check_identity
from weightstream.sources.local.regular import open_regular


class MappedFile:
    """A private (copy-on-write) mapping of a whole file, for ``zero_copy`` loads.

    Tensors are views of the file's page-cache pages: no copy, no fresh memory, but they are
    not owned. Writing to one copies that page privately; truncating the file while one lives
    makes reading it fault (SIGBUS). The mapping holds no file descriptor (torch's file mapping
    closes its own), so a thousand mapped shards cost no descriptors.
    """

    def __init__(self, path: str, size: int, version: str | None = None) -> None:
        self.path, self.size, self.version = path, size, version
        fd, status = open_regular(path)
        os.close(fd)
        check_identity(path, size, version, status)  # the file planned; a mapping past its end would fault
        if size == 0:
            self._bytes = torch.empty(0, dtype=torch.uint8)
            return
        try:
            self._bytes = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
        except RuntimeError as error:
            raise SourceError(f"{path}: cannot map {size} bytes: {error}") from error
        self.verify_unchanged()

    @property
    def bytes(self) -> torch.Tensor:
        """The file's bytes (uint8), a view of the mapping: slice it, view it as tensors."""
        return self._bytes

    def verify_unchanged(self) -> None:
        """Raise :class:`SourceChangedError` if the file at the path is no longer the one planned (replaced,
        or written in place: the mapping's unwritten pages would show the new bytes)."""
        try:
            status = os.stat(self.path)
        except FileNotFoundError:
            raise SourceChangedError(
                f"{self.path}: was removed or renamed after its header was read; load again"
            ) from None
        check_identity(self.path, self.size, self.version, status)

    def close(self) -> None:
        """Let go of this object's reference to the mapping (tensors viewing it keep it); idempotent."""
        self._bytes = torch.empty(0, dtype=torch.uint8)
