"""How to write a checkpoint each registered loader reads: a new loader adds one line here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.conftest import save_hf_sharded

Writer = Callable[[dict[str, torch.Tensor], Path], str]


def single_file(state: dict[str, torch.Tensor], directory: Path) -> str:
    path = directory / "model.safetensors"
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata={"format": "pt"})
    return str(path)


def hf_sharded(state: dict[str, torch.Tensor], directory: Path) -> str:
    return str(save_hf_sharded(state, directory, shards=3))


WRITERS: dict[str, list[Writer]] = {
    "safetensors": [single_file, hf_sharded],
}
"""Each loader's checkpoint writers; the conformance suite runs every loader on each of its layouts."""
