"""``Checkpoint.get_slice(name)[index]``: only the bytes an index selects, read through the checkpoint's loader.

The index becomes runs of bytes (``weightstream.planning.slices``); each run is read as a piece of the tensor (a
``uint8`` tensor of its own) through the loader, its reader and its checks, to the checkpoint's destination, where the
pieces are joined and indexed.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from weightstream.checkpoint.reading import CheckpointReads
from weightstream.formats.safetensors import DTYPE_NAMES
from weightstream.planning.plan import TensorSpec
from weightstream.planning.slices import plan_slice
from weightstream.sources import REMOTE_SCHEMES

LOCAL_RUN_COST_BYTES = 64 << 10
"""A slice reads up to this many unwanted bytes of a local file to save one positional read."""
REMOTE_RUN_COST_BYTES = 1 << 20
"""The same for an object: a range request costs about a millisecond, a megabyte at object-store speeds."""


class TensorSlice:
    """One stored tensor, not read yet: ``[index]`` (ints, slices with positive steps, ``...``) reads
    the bytes the index selects and returns them as a new tensor on the checkpoint's destination.
    Rows (a range of dimension 0) are one read; other selections are as few reads as are worth it
    (see ``weightstream.planning.slices``). ``get_shape()`` and ``get_dtype()`` are ``safetensors``'.

    Example:
        >>> head = checkpoint.get_slice("lm_head.weight")  # doctest: +SKIP
        >>> head.shape, head[:, :128].shape  # doctest: +SKIP
        ((128256, 4096), (128256, 128))
    """

    def __init__(self, checkpoint: CheckpointReads, spec: TensorSpec) -> None:
        self._checkpoint = checkpoint
        self._spec = spec

    @property
    def shape(self) -> tuple[int, ...]:
        return self._spec.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._spec.dtype

    def get_shape(self) -> list[int]:
        return list(self._spec.shape)

    def get_dtype(self) -> str:
        return DTYPE_NAMES[self._spec.dtype]

    def __getitem__(self, index: object) -> torch.Tensor:
        checkpoint, spec = self._checkpoint, self._spec
        checkpoint._check_open()
        cost = REMOTE_RUN_COST_BYTES if checkpoint.uri.startswith(REMOTE_SCHEMES) else LOCAL_RUN_COST_BYTES
        planned = plan_slice(spec.shape, spec.dtype.itemsize, index, run_cost_bytes=cost)
        started = time.perf_counter()
        if planned.runs:
            values = _read_runs(checkpoint, spec, planned.runs).view(spec.dtype).reshape(planned.read_shape)
            values = values[planned.index]
            values = values.clone() if values.untyped_storage().nbytes() > values.nbytes else values.contiguous()
        else:
            values = torch.empty(planned.shape, dtype=spec.dtype, device=checkpoint.options.device)
        checkpoint._counted(1, values.nbytes, planned.read_bytes, time.perf_counter() - started)
        return values

    def __repr__(self) -> str:
        return f"<weightstream.TensorSlice {self._spec.name!r} {self.get_dtype()} {list(self._spec.shape)}>"


def _read_runs(checkpoint: CheckpointReads, spec: TensorSpec, runs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The bytes of ``runs`` (offsets from the tensor's first byte), concatenated, on the checkpoint's destination.

    Pieces are read into memory of their own (no views of a whole mapping, no cuFile for a few bytes), as copies
    a loader that reuses buffers hands over for keeps, and without a ``layer_hook`` (it transforms layers, not bytes
    of one tensor).
    """
    pieces = tuple(
        TensorSpec(
            f"{spec.name}[bytes {offset}:{offset + nbytes}]",
            torch.uint8,
            (nbytes,),
            spec.file,
            spec.offset + offset,
            nbytes,
        )
        for offset, nbytes in runs
    )
    opts = checkpoint._kept_options()
    own = opts.loader_options
    if own is not None and "layer_hook" in {field.name for field in dataclasses.fields(own)}:
        own = dataclasses.replace(own, layer_hook=None)  # type: ignore[type-var]
    piece_opts = dataclasses.replace(opts, zero_copy=False, gds=False, loader_options=own)
    read = checkpoint._read_part(pieces, piece_opts, counted=False)
    ordered = [read[piece.name] for piece in pieces]
    joined = ordered[0] if len(ordered) == 1 else torch.cat(ordered)
    # A tensor stored at an offset that is no multiple of its element size (a writer may put one there) is viewed
    # from an aligned copy: torch views a dtype only at a storage offset its element size divides.
    return joined.clone() if joined.storage_offset() % spec.dtype.itemsize else joined
