"""What a checkpoint's iterators (:mod:`~weightstream.checkpoint.reads`) and slices
(:mod:`~weightstream.checkpoint.slices`) ask of the checkpoint they read: its name, options and state, and the counts
and partial reads its handle keeps. :class:`~weightstream.checkpoint.handle.Checkpoint` is one; the iterators and
slices depend on this shape, not on the handle, which builds them.

Example:
    >>> import tempfile, torch, safetensors.torch, weightstream
    >>> path = tempfile.mkdtemp() + "/model.safetensors"
    >>> safetensors.torch.save_file({"w": torch.zeros(2)}, path)
    >>> with weightstream.open(path) as checkpoint:
    ...     isinstance(checkpoint, CheckpointReads)
    True
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from weightstream.options import LoadOptions
from weightstream.planning.plan import TensorSpec


@runtime_checkable
class CheckpointReads(Protocol):
    """The checkpoint an iterator or a slice reads (see the module's docstring)."""

    @property
    def uri(self) -> str: ...

    @property
    def options(self) -> LoadOptions: ...

    @property
    def closed(self) -> bool: ...

    def _check_open(self) -> None: ...

    def _counted(self, tensors: int, tensor_bytes: int, read_bytes: int, waited: float) -> None: ...

    def _kept_options(self) -> LoadOptions: ...

    def _read_part(
        self, tensors: tuple[TensorSpec, ...], opts: LoadOptions, counted: bool = True
    ) -> dict[str, torch.Tensor]: ...
