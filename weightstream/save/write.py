"""Writing a safetensors file in one go (demo checkpoints, tests): header, then tensor bytes in order.

The saver (``save/saver.py``) writes sharded checkpoints atomically; this is the plain single-file write.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from weightstream.formats.encoding import encode_header, tensor_pieces


def write_safetensors(
    path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Write ``tensors`` (CPU) to ``path`` in the given order; returns the file size.

    Example:
        >>> write_safetensors("/tmp/w.safetensors", {"w": torch.ones(3)})  # doctest: +SKIP
        84
    """
    header = encode_header(tensors, metadata)
    with open(path, "wb") as file:
        file.write(header)
        for tensor in tensors.values():
            file.writelines(tensor_pieces(tensor))
        return file.tell()
