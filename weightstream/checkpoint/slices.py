"""``Checkpoint.get_slice(name)[index]``: only the bytes an index selects, read through the checkpoint's loader.

The index becomes runs of bytes (``weightstream.planning.slices``); each run is read as a piece of the tensor (a
``uint8`` tensor of its own) through the loader, its reader and its checks, to the checkpoint's destination, where the
pieces are joined and indexed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import torch

from weightstream.checkpoint.reading import CheckpointReads
from weightstream.errors import SliceIndexError, SliceTypeError, SliceValueError
from weightstream.formats.safetensors import DTYPE_NAMES
from weightstream.planning.plan import TensorSpec
from weightstream.planning.slices import is_basic, plan_slice
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
        started = time.perf_counter()
        basic = is_basic(index)
        with self._named_errors():
            planned = plan_slice(spec.shape, spec.dtype.itemsize, index if basic else Ellipsis, run_cost_bytes=cost)
            # torch's other indexes are checked, and their result's shape found, before any byte is read
            shape = planned.shape if basic else self._indexed_shape(index)
        read_bytes = planned.read_bytes if planned.runs and 0 not in shape else 0
        if read_bytes:
            values = _read_runs(checkpoint, spec, planned.runs).view(spec.dtype).reshape(planned.read_shape)
            values = values[planned.index] if basic else _as_bits(values)[index].view(spec.dtype)  # type: ignore[index]
            values = values.clone() if values.untyped_storage().nbytes() > values.nbytes else values.contiguous()
        else:
            values = torch.empty(shape, dtype=spec.dtype, device=checkpoint.options.device)
        checkpoint._counted(1, values.nbytes, read_bytes, time.perf_counter() - started)
        return values

    def _indexed_shape(self, index: object) -> tuple[int, ...]:
        """The shape of ``tensor[index]`` as torch gives it, or torch's error, from a tensor of the same shape that
        holds one byte (a meta tensor checks no integer's range, and raises other types)."""
        stand_in = torch.empty((), dtype=torch.uint8).expand(self._spec.shape)
        return tuple(stand_in[index].shape)  # type: ignore[index]

    @contextlib.contextmanager
    def _named_errors(self) -> Iterator[None]:
        """An index refused (by the planner or by torch) as one of ours naming the tensor, of the same built-in
        type as torch's."""
        try:
            yield
        except (IndexError, TypeError, ValueError) as error:
            kind = (
                SliceIndexError
                if isinstance(error, IndexError)
                else SliceTypeError
                if isinstance(error, TypeError)
                else SliceValueError
            )
            raise kind(f"tensor {self._spec.name!r} {list(self._spec.shape)}: {error}") from None

    def __repr__(self) -> str:
        return f"<weightstream.TensorSlice {self._spec.name!r} {self.get_dtype()} {list(self._spec.shape)}>"


BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""An integer type of each item size: torch indexes its bits for every dtype (it has no ``index`` for ``float4``)."""


def _as_bits(values: torch.Tensor) -> torch.Tensor:
    return values.view(BITS_OF_SIZE[values.element_size()])


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
