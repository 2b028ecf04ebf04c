"""Encoding safetensors (pure, no I/O): the header for tensors stored in order, and the bytes of each tensor."""

from __future__ import annotations

import ctypes
import json
import struct
from collections.abc import Iterator, Mapping

import torch

from weightstream.formats.safetensors import DTYPE_NAMES, PACKED_PAIRS

ALIGNMENT = 8
"""The header is padded with spaces so the data section starts 8-byte aligned."""


def encode_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length plus the padded JSON header for ``tensors`` stored in order.

    Example:
        >>> encode_header({"w": torch.zeros(2, dtype=torch.uint8)})[:8]
        b'8\\x00\\x00\\x00\\x00\\x00\\x00\\x00'
    """
    document: dict[str, object] = {}
    if metadata:
        document["__metadata__"] = dict(metadata)
    offset = 0
    for name, tensor in tensors.items():
        dtype_name = DTYPE_NAMES[tensor.dtype]
        shape = list(tensor.shape)
        if dtype_name in PACKED_PAIRS:
            shape[-1] *= 2
        nbytes = tensor.numel() * tensor.element_size()
        document[name] = {"dtype": dtype_name, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(document, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(len(raw) + 8) % ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw


def tensor_pieces(tensor: torch.Tensor, piece_bytes: int = 64 << 20) -> Iterator[memoryview]:
    """The bytes of ``tensor`` as a safetensors file stores them, in pieces of at most ``piece_bytes``
    (copied to the CPU and made contiguous first if need be; valid while the iteration runs).

    Example:
        >>> [bytes(piece) for piece in tensor_pieces(torch.tensor([1, 2], dtype=torch.int16), piece_bytes=2)]
        [b'\\x01\\x00', b'\\x02\\x00']
    """
    contiguous = tensor.detach().to("cpu").contiguous()
    nbytes = contiguous.numel() * contiguous.element_size()
    if nbytes:
        view = memoryview((ctypes.c_char * nbytes).from_address(contiguous.data_ptr()))
        for start in range(0, nbytes, piece_bytes):
            yield view[start : start + piece_bytes]
