"""Checking that a load's bytes are the checkpoint's, on any device: per tensor, the exact sum of its bytes, taken
256 MiB at a time (the same integers from a CPU load and from a GPU one, without a copy to the host)."""

from __future__ import annotations

import torch

CHUNK_BYTES = 1 << 28


def byte_sums(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Each tensor's bytes, summed.

    Example:
        >>> byte_sums({"w": torch.tensor([1, 2], dtype=torch.uint8)})
        {'w': 3}
    """
    sums = {}
    for name, tensor in tensors.items():
        flat, total = tensor.reshape(-1).view(torch.uint8), 0
        for start in range(0, flat.numel(), CHUNK_BYTES):
            total += int(flat[start : start + CHUNK_BYTES].to(torch.int32).sum().item())
        sums[name] = total
    return sums
