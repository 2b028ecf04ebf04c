"""Which bytes of a stored tensor a slice needs, as few reads as it is worth.

Pure functions, no I/O. A slice ``tensor[index]`` (integers, slices with a positive step,
``...``) of a C-contiguous tensor is a set of byte runs. Reading each selected element on its
own would cost a request per element; reading the whole tensor, bytes the caller did not ask
for. :func:`plan_slice` picks the level between the two: at level ``L`` one run covers the
selected range of dimension ``L`` (first to last selected index, the dimensions after it whole)
for each selected index of the dimensions before it. It takes the level that costs least,
counting each run as ``run_cost_bytes`` of reading, with at most ``max_runs`` runs; the exact
level (no byte read that is not wanted) is the deepest.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from typing import SupportsIndex

from weightstream.errors import SliceIndexError, SliceTypeError, SliceValueError

MAX_RUNS = 4096
"""Runs of one slice at most: each is a positional read (or an HTTP range request)."""


@dataclasses.dataclass(frozen=True)
class Selection:
    """One dimension's selected indices: ``start, start + step, ...``, ``count`` of them."""

    start: int
    count: int
    step: int
    squeeze: bool
    """The index was an integer: the dimension is dropped from the result."""


@dataclasses.dataclass(frozen=True)
class SlicePlan:
    """The reads of one slice and how their bytes become the result."""

    runs: tuple[tuple[int, int], ...]
    """``(offset, nbytes)`` from the tensor's first byte, in order, adjacent runs merged."""
    read_shape: tuple[int, ...]
    """The runs' bytes, concatenated, seen as elements of this shape."""
    index: tuple[int | slice, ...]
    """Applied to that view, it gives the result."""
    shape: tuple[int, ...]
    """The result's shape."""

    @property
    def read_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.runs)


def selections(shape: tuple[int, ...], index: object) -> list[Selection]:
    """The per-dimension selection of ``index`` on a tensor of ``shape``, as torch reads it.

    Raises:
        SliceIndexError: too many indices, or an integer out of range.
        SliceTypeError: an index of a kind other than int, slice or ``...``.
        SliceValueError: a slice step of zero or below (torch has no negative steps).

    Example:
        >>> selections((4, 6), (1, slice(None, None, 2)))
        [Selection(start=1, count=1, step=1, squeeze=True), Selection(start=0, count=3, step=2, squeeze=False)]
    """
    parts = index if isinstance(index, tuple) else (index,)
    ellipses = sum(part is Ellipsis for part in parts)
    if ellipses > 1:
        raise SliceIndexError("an index can only have a single ellipsis ('...')")
    for part in parts:
        if part is not Ellipsis and not isinstance(part, slice) and not _is_int(part):
            raise SliceTypeError(f"a slice index is an int, a slice or '...', got {type(part).__name__} ({part!r})")
    given = len(parts) - ellipses
    if given > len(shape):
        raise SliceIndexError(f"too many indices for a tensor of {len(shape)} dimensions: {given}")
    if ellipses:
        at = parts.index(Ellipsis)
        parts = parts[:at] + (slice(None),) * (len(shape) - given) + parts[at + 1 :]
    parts = parts + (slice(None),) * (len(shape) - len(parts))
    return [_selection(part, size, dim) for dim, (part, size) in enumerate(zip(parts, shape, strict=True))]


def is_basic(index: object) -> bool:
    """Whether ``index`` is one :func:`plan_slice` reads exactly: integers, slices and at most one ``...``
    (torch's other indexes, lists, tensors, ``None`` and masks, are applied to the whole tensor).

    Example:
        >>> is_basic((0, slice(2, 4), ...)), is_basic([0, 2]), is_basic((None, 0))
        (True, False, False)
    """
    parts = index if isinstance(index, tuple) else (index,)
    return sum(part is Ellipsis for part in parts) <= 1 and all(
        part is Ellipsis or isinstance(part, slice) or _is_int(part) for part in parts
    )


def plan_slice(
    shape: tuple[int, ...], itemsize: int, index: object, run_cost_bytes: int, max_runs: int = MAX_RUNS
) -> SlicePlan:
    """The reads of ``tensor[index]`` for a C-contiguous tensor of ``shape`` and ``itemsize``.

    Example:
        >>> plan_slice((4, 6), 2, slice(1, 3), run_cost_bytes=4096).runs  # rows 1 and 2: one run
        ((12, 24),)
        >>> plan_slice((4, 6), 2, (slice(None), 0), run_cost_bytes=0).runs  # a column: one run per row
        ((0, 2), (12, 2), (24, 2), (36, 2))
    """
    chosen = selections(shape, index)
    result_shape = tuple(selection.count for selection in chosen if not selection.squeeze)
    if any(selection.count == 0 for selection in chosen):
        return SlicePlan((), (0,), (slice(None),), result_shape)
    strides = [itemsize * math.prod(shape[dim + 1 :]) for dim in range(len(shape))]
    exact = _exact_level(shape, chosen)
    level = min(range(exact + 1), key=lambda at: (_cost(chosen, strides, itemsize, at, run_cost_bytes, max_runs), -at))
    runs = _merged(_runs(chosen, strides, itemsize, level))
    read_shape = tuple(selection.count for selection in chosen[:level])
    view_index: list[int | slice] = [0 if selection.squeeze else slice(None) for selection in chosen[:level]]
    if level < len(shape):
        selection = chosen[level]
        read_shape += ((selection.count - 1) * selection.step + 1, *shape[level + 1 :])
        view_index.append(0 if selection.squeeze else slice(None, None, selection.step))
        for later in chosen[level + 1 :]:
            view_index.append(
                later.start
                if later.squeeze
                else slice(later.start, later.start + (later.count - 1) * later.step + 1, later.step)
            )
    return SlicePlan(tuple(runs), read_shape, tuple(view_index), result_shape)


def _selection(part: object, size: int, dim: int) -> Selection:
    if isinstance(part, slice):
        for bound in (part.start, part.stop, part.step):
            if bound is not None and not _is_index(bound):
                raise SliceTypeError(f"dimension {dim}: slice bounds and steps are integers, got {bound!r}")
        if part.step is not None and operator.index(part.step) <= 0:
            raise SliceValueError(
                f"dimension {dim}: slice step must be a positive integer (torch has no negative steps), got "
                f"{part.step!r}"
            )
        start, stop, step = part.indices(size)
        return Selection(start, len(range(start, stop, step)), step, squeeze=False)
    assert isinstance(part, int)
    if not -size <= part < size:
        raise SliceIndexError(f"index {part} is out of bounds for dimension {dim} with size {size}")
    return Selection(part % size, 1, 1, squeeze=True)


def _exact_level(shape: tuple[int, ...], chosen: list[Selection]) -> int:
    """The deepest level worth reading at: below it every run would be a whole block anyway."""
    partial = [
        dim
        for dim, selection in enumerate(chosen)
        if (selection.start, selection.count, selection.step) != (0, shape[dim], 1)
    ]
    if not partial:
        return 0
    last = partial[-1]
    return last if chosen[last].step == 1 or chosen[last].count == 1 else last + 1


def _span(chosen: list[Selection], strides: list[int], itemsize: int, level: int) -> int:
    if level == len(chosen):
        return itemsize
    selection = chosen[level]
    return ((selection.count - 1) * selection.step + 1) * strides[level]


def _cost(
    chosen: list[Selection], strides: list[int], itemsize: int, level: int, run_cost_bytes: int, max_runs: int
) -> float:
    runs = math.prod(selection.count for selection in chosen[:level])
    if runs > max_runs:
        return math.inf
    return runs * (_span(chosen, strides, itemsize, level) + run_cost_bytes)


def _runs(chosen: list[Selection], strides: list[int], itemsize: int, level: int) -> list[tuple[int, int]]:
    span = _span(chosen, strides, itemsize, level)
    first = chosen[level].start * strides[level] if level < len(chosen) else 0
    outer = [range(s.start, s.start + s.count * s.step, s.step) for s in chosen[:level]]
    return [
        (first + sum(i * stride for i, stride in zip(indices, strides, strict=False)), span)
        for indices in itertools.product(*outer)
    ]


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for offset, nbytes in runs:
        if merged and sum(merged[-1]) == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + nbytes)
        else:
            merged.append((offset, nbytes))
    return merged


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_index(value: object) -> bool:
    """An integer as a slice takes it (a NumPy integer, a one-element integer tensor), as Python's ``slice`` does."""
    if not isinstance(value, SupportsIndex):
        return False
    try:
        operator.index(value)  # a tensor of several elements has the method, and refuses
    except TypeError:
        return False
    return True
