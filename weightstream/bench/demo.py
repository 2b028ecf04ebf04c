"""Llama-shaped random checkpoints in the Hugging Face sharded layout.

Used by ``weightstream bench`` (without a URI) and by the tests. Names and shapes follow
Llama (grouped-query attention, gated MLP); the values are random.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator

import torch

from weightstream.errors import InvalidOptionError
from weightstream.formats.index import INDEX_NAME
from weightstream.save.write import write_safetensors

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a Llama-style model."""

    hidden: int = 2048
    intermediate: int = 5632
    layers: int = 8
    vocab: int = 32000
    kv_heads_fraction: int = 4
    """Key/value projections are ``hidden / kv_heads_fraction`` wide (grouped-query attention)."""

    def tensor_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        h, kv = self.hidden, self.hidden // self.kv_heads_fraction
        yield "model.embed_tokens.weight", (self.vocab, h)
        for layer in range(self.layers):
            prefix = f"model.layers.{layer}."
            yield prefix + "input_layernorm.weight", (h,)
            yield prefix + "self_attn.q_proj.weight", (h, h)
            yield prefix + "self_attn.k_proj.weight", (kv, h)
            yield prefix + "self_attn.v_proj.weight", (kv, h)
            yield prefix + "self_attn.o_proj.weight", (h, h)
            yield prefix + "post_attention_layernorm.weight", (h,)
            yield prefix + "mlp.gate_proj.weight", (self.intermediate, h)
            yield prefix + "mlp.up_proj.weight", (self.intermediate, h)
            yield prefix + "mlp.down_proj.weight", (h, self.intermediate)
        yield "model.norm.weight", (h,)
        yield "lm_head.weight", (self.vocab, h)

    def nbytes(self, dtype: torch.dtype = torch.bfloat16) -> int:
        return sum(math.prod(shape) for _, shape in self.tensor_shapes()) * dtype.itemsize

    @classmethod
    def of_size(cls, target_bytes: int, dtype: torch.dtype = torch.bfloat16, layers: int | None = None) -> LlamaShape:
        """The shape closest to ``target_bytes``: 2048 wide with as many layers as it takes, or, given
        ``layers``, that many layers as wide (in steps of 256, the MLP 2.75x as wide) as it takes. Below one layer
        of 2048 (0.33 GiB), narrower (down to 64) with two layers, and with a smaller vocabulary where Llama's
        cannot come within 10%.

        Raises:
            InvalidOptionError: no shape is within 25% of ``target_bytes``.

        Example:
            >>> LlamaShape.of_size(1 << 30).layers
            9
            >>> LlamaShape.of_size(2 << 30, layers=16).hidden
            2304
            >>> small = LlamaShape.of_size(64 << 20)
            >>> (small.hidden, small.layers, small.vocab), round(small.nbytes() / 2**20)
            ((1024, 2, 4000), 59)
        """
        if layers is None and target_bytes >= cls(layers=1).nbytes(dtype):
            base = cls(layers=0).nbytes(dtype)
            per_layer = cls(layers=1).nbytes(dtype) - base
            return cls(layers=max(1, round((target_bytes - base) / per_layer)))
        hiddens = (64, 128, *range(256, 16385, 256))
        closest = []
        for vocab in (32000, 4000, 500):  # Llama's vocabulary where a shape with it is within 10%
            shapes = [cls(hidden, max(256, round(hidden * 2.75 / 256) * 256), layers or 2, vocab) for hidden in hiddens]
            closest.append(min(shapes, key=lambda shape: abs(shape.nbytes(dtype) - target_bytes)))
            if abs(closest[-1].nbytes(dtype) - target_bytes) <= target_bytes / 10:
                return closest[-1]
        closest = min(closest, key=lambda shape: abs(shape.nbytes(dtype) - target_bytes))
        if abs(closest.nbytes(dtype) - target_bytes) > target_bytes / 4:
            raise InvalidOptionError(
                f"a demo checkpoint of {target_bytes} bytes{f' with {layers} layers' if layers else ''}: the closest "
                f"Llama shape holds {closest.nbytes(dtype)} bytes (more than 25% off); ask for another size"
                + (" or another number of layers" if layers else "")
            )
        return closest

    def directory_name(self, shards: int) -> str:
        """The demo cache's name for this shape in ``shards`` files (what differs from the defaults in it).

        Example:
            >>> LlamaShape(layers=9).directory_name(2), LlamaShape(hidden=64, layers=2, vocab=500).directory_name(1)
            ('demo-llama-9l-2s', 'demo-llama-2l-64h-500v-1s')
        """
        width = "" if self.hidden == LlamaShape.hidden else f"{self.hidden}h-"
        vocabulary = "" if self.vocab == LlamaShape.vocab else f"{self.vocab}v-"
        return f"demo-llama-{self.layers}l-{width}{vocabulary}{shards}s"


def llama_state_dict(shape: LlamaShape, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors with Llama names and shapes.

    Example:
        >>> sd = llama_state_dict(LlamaShape(hidden=64, intermediate=128, layers=2, vocab=100))
        >>> sd["model.layers.1.mlp.down_proj.weight"].shape
        torch.Size([64, 128])
    """
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.empty(dims, dtype=dtype).normal_(0, 0.02, generator=generator)
        for name, dims in shape.tensor_shapes()
    }


def write_sharded(state_dict: dict[str, torch.Tensor], directory: str | os.PathLike[str], shards: int) -> list[str]:
    """Write ``state_dict`` as ``shards`` files plus ``model.safetensors.index.json``; returns the file paths."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    written = 0
    for name, tensor in state_dict.items():
        groups[min(shards - 1, written * shards // max(total, 1))][name] = tensor
        written += tensor.numel() * tensor.element_size()
    paths, weight_map = [], {}
    for number, group in enumerate(groups, start=1):
        file_name = f"model-{number:05d}-of-{shards:05d}.safetensors"
        paths.append(os.path.join(directory, file_name))
        write_safetensors(paths[-1], group, {"format": "pt"})
        weight_map.update({name: file_name for name in group})
    with open(os.path.join(directory, INDEX_NAME), "w") as index:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, index, indent=2)
    return paths


def demo_checkpoint(
    size_bytes: int = GIB, shards: int = 2, cache_dir: str | None = None, layers: int | None = None
) -> str:
    """The path of a cached demo checkpoint of ``size_bytes`` within 25% (with ``layers`` layers if given), built
    on first use.

    Raises:
        InvalidOptionError: no Llama shape is that size.

    Example:
        >>> path = demo_checkpoint(256 << 20)  # doctest: +SKIP
    """
    cache_dir = cache_dir or os.environ.get(
        "WEIGHTSTREAM_DEMO_DIR", os.path.join(os.path.expanduser("~"), ".cache", "weightstream")
    )
    shape = LlamaShape.of_size(size_bytes, layers=layers)
    target = os.path.join(cache_dir, shape.directory_name(shards))
    if os.path.exists(os.path.join(target, INDEX_NAME)):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".demo-", dir=cache_dir)
    try:
        write_sharded(llama_state_dict(shape), staging, shards)
        os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache is for every user of the machine
        os.replace(staging, target)
    except OSError:
        if os.path.exists(os.path.join(target, INDEX_NAME)):  # another process won the race
            shutil.rmtree(staging, ignore_errors=True)
            return target
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
