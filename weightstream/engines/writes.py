"""Which bytes of a model's parameters a load wrote, seen from the writes themselves.

Engines' weight loaders fuse, narrow and rename checkpoint tensors on their way into parameters
(``q_proj``, ``k_proj`` and ``v_proj`` into one ``qkv_proj``), and not every model's
``load_weights`` says what it filled (SGLang's Llama returns nothing). :class:`WriteRecorder`
watches every in-place operation of the thread that loads (below autograd, so ``param.data.copy_``
counts) and records the byte range it wrote, per storage; a parameter is filled when every byte
of it was written. A fused parameter whose ``k`` and ``v`` parts never came is therefore unfilled.
A write through a strided view is counted as its whole span (it cannot make a parameter look
unfilled; it can miss a gap between its strides).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

StorageKey = tuple[torch.device, int]


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` bytes of ``tensor``'s storage that its elements lie in (``(0, 0)`` when empty).

    Example:
        >>> base = torch.zeros(4, 3)
        >>> byte_span(base[1:3]), byte_span(base[:, 1])
        ((12, 36), (4, 44))
    """
    if tensor.numel() == 0:
        return 0, 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.storage_offset() * tensor.element_size()
    return start, start + extent * tensor.element_size()


def storage_key(tensor: torch.Tensor) -> StorageKey:
    return tensor.device, tensor.untyped_storage().data_ptr()


class WriteRecorder(TorchDispatchMode):
    """Records the bytes every in-place operation writes while it is entered (in this thread).

    Example:
        >>> parameter = torch.zeros(4, 3)
        >>> with WriteRecorder() as writes:
        ...     _ = parameter[:2].copy_(torch.ones(2, 3))
        >>> writes.unfilled({"weight": parameter})
        ['weight']
        >>> with writes:
        ...     _ = parameter[2:].fill_(1.0)
        >>> writes.unfilled({"weight": parameter})
        []
    """

    def __init__(self) -> None:
        super().__init__()
        self._spans: dict[StorageKey, list[tuple[int, int]]] = defaultdict(list)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                written = args[index] if index < len(args) else kwargs.get(argument.name)
                for tensor in written if isinstance(written, (list, tuple)) else (written,):
                    if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                        self._spans[storage_key(tensor)].append(byte_span(tensor))
        return func(*args, **kwargs)

    def forget(self, tensors: Iterable[torch.Tensor]) -> None:
        """Drop what was recorded in the storages of ``tensors``: memory just given to them may have
        held something written earlier while recording."""
        for tensor in tensors:
            self._spans.pop(storage_key(tensor), None)

    def unfilled(self, parameters: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """The names of ``parameters`` not every byte of which was written (a meta parameter never is)."""
        merged = {key: _merge(spans) for key, spans in self._spans.items()}
        items = parameters.items() if isinstance(parameters, dict) else parameters
        return [
            name
            for name, tensor in items
            if tensor.numel()
            and (
                tensor.device.type == "meta"
                or not _covers(merged.get(storage_key(tensor), ([], [])), byte_span(tensor))
            )
        ]


def _merge(spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Disjoint sorted spans, as (starts, ends)."""
    starts: list[int] = []
    ends: list[int] = []
    for start, end in sorted(spans):
        if ends and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return starts, ends


def _covers(merged: tuple[list[int], list[int]], span: tuple[int, int]) -> bool:
    starts, ends = merged
    index = bisect.bisect_right(starts, span[0]) - 1
    return index >= 0 and ends[index] >= span[1]
