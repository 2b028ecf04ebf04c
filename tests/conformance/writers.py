"""How to write a checkpoint each registered loader reads: a new loader adds one line here."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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


def sharded_state(state: dict[str, torch.Tensor], directory: Path) -> str:
    """weightstream's save, world size 1, cut into parts of about a third of the state."""
    import weightstream

    total = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
    weightstream.save_sharded_state(state, directory, rank=0, world_size=1, max_file_bytes=max(1, total // 3))
    return str(directory)


GUARDED_WRITERS: frozenset[Writer] = frozenset({sharded_state})
"""Writers whose manifest records each file: a file rewritten behind its back is refused, not read."""


WRITERS: dict[str, list[Writer]] = {
    "safetensors": [single_file, hf_sharded],
    "streaming": [single_file, hf_sharded],
    "layered": [single_file, hf_sharded],
    "sharded-state": [sharded_state],  # directories the engines write: tests/test_sharded_state.py
    "distributed": [single_file],  # as a group of one here; several ranks and shards: tests/test_distributed.py
}
"""Each loader's checkpoint writers; the conformance suite runs every loader on each of its layouts."""

REFUSED_OPTIONS: dict[str, frozenset[str]] = {
    "streaming": frozenset({"zero_copy"}),  # it reads into a bounded window of its own memory, not file mappings
    "layered": frozenset({"zero_copy"}),  # it reads into buffers it reuses, not file mappings
    "distributed": frozenset({"zero_copy"}),  # each rank reads a share into memory of its own
}
"""Options a loader refuses by design; the conformance suite checks the refusal instead of the load."""


KEEPING_OPTIONS: dict[str, dict[str, object]] = {
    "layered": {"copy_layers": True},  # its tensors are views of reused buffers unless copied
}
"""Options a caller that keeps every tensor ``iter_weights`` yields must pass to each loader."""


@contextlib.contextmanager
def running(name: str, directory: Path) -> Iterator[None]:
    """What loader ``name`` needs around it: the distributed loader, a torch.distributed group (of one;
    gloo, and NCCL for CUDA tensors where there is a GPU)."""
    if name != "distributed":
        yield
        return
    import torch
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{directory / '.rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def refuses(name: str, options: dict, uri: str) -> bool:
    """Whether loader ``name`` refuses one of ``options`` (set to a true value); if so, that it does
    so at call time with an ``InvalidOptionError`` naming the option."""
    import pytest

    import weightstream

    refused = [option for option in REFUSED_OPTIONS.get(name, ()) if options.get(option)]
    if not refused:
        return False
    with pytest.raises(weightstream.InvalidOptionError, match=refused[0]):
        weightstream.iter_weights(uri, format=name, **options)
    return True
