"""A caller's use of the public API, type-checked by mypy --strict (tests/test_typing.py)."""

from __future__ import annotations

import torch

import weightstream


def usage(path: str) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = weightstream.load_weights(path, device="cpu", threads=4)
    with weightstream.open(path, "safetensors", pin_memory="auto") as checkpoint:
        names: list[str] = checkpoint.keys()
        first: torch.Tensor = checkpoint.get_tensor(names[0])
        rows: torch.Tensor = checkpoint.get_slice(names[0])[:2]
        total: int = checkpoint.plan.total_bytes
        for name, tensor in checkpoint.iter_weights():
            weights[name] = tensor + first.sum() + rows.sum() + total
    for key, layer in weightstream.iter_layers(path, prefetch_layers=2):
        weights.update({f"{key}/{name}": tensor for name, tensor in layer.items()})
    options = weightstream.LoadOptions(direct_io="auto", huge_pages=False)
    formats: list[str] = weightstream.available_loaders()
    assert options.reader_threads > 0 and formats
    return weights
