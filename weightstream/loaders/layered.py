"""The ``layered`` loader: layer by layer, in layer order, through a few reused buffers."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import ClassVar

import torch

from weightstream.errors import InvalidOptionError
from weightstream.loaders.safetensors import plan_checkpoint
from weightstream.memory.devices import check_destination
from weightstream.options import LoadOptions
from weightstream.planning.layers import Layer, group_layers
from weightstream.planning.plan import LoadPlan
from weightstream.readers.layered import Tensors, read_layers
from weightstream.sources import Store

log = logging.getLogger(__name__)


class LayeredLoader:
    """Reads safetensors checkpoints one layer at a time, embeddings first, then ``layers.0``,
    ``layers.1``, ..., then the final norm and the head (``layer_rule`` says what a layer is).

    Memory: ``prefetch_layers + 1`` buffers of the largest layer's size, allocated once and reused
    (plus the staging ring on a GPU), whatever the size of the checkpoint. Yielded tensors are views
    of those buffers: when asking for a layer the caller may still hold at most ``prefetch_layers``
    earlier layers (else ``LayerInUseError``), or it passes ``copy_layers=True`` and keeps copies.
    """

    name: ClassVar[str] = "layered"
    reuses_memory: ClassVar[bool] = True
    """Yielded tensors share buffers that later layers reuse: ``load_weights``, which keeps them all, asks for copies."""

    def check(self, opts: LoadOptions) -> None:
        opts.refuse({
            "zero_copy": "maps whole files, while this loader reads into buffers it reuses; use format='safetensors'",
            "max_inflight_bytes": "this loader's memory is bounded by prefetch_layers instead",
        })
        opts.refuse_foreign(self.name)
        if opts.gds is True:
            raise InvalidOptionError("gds=True: the layered loader reaches a GPU through the pinned staging ring, not cuFile")
        check_destination(opts.device, opts.pin_memory)

    def plan(self, store: Store, uri: str, opts: LoadOptions) -> LoadPlan:
        plan = plan_checkpoint(store, uri, opts)
        group_layers(plan.tensors, opts.layer_rule)  # a rule that fails on a name fails here, before any read
        return plan

    def iter_layers(self, store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, Tensors]]:
        """Yield ``(layer key, {name: tensor})`` for each layer of ``plan``, in layer order."""
        pinned = check_destination(opts.device, opts.pin_memory)
        layers = group_layers(plan.tensors, opts.layer_rule)
        return _read(store, plan, layers, opts, pinned)

    def iter_weights(self, store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of :meth:`iter_layers`, one by one: layer after layer, each in stored order."""
        return _one_by_one(self.iter_layers(store, plan, opts))


def _read(store: Store, plan: LoadPlan, layers: list[Layer], opts: LoadOptions, pinned: bool) -> Iterator[tuple[str, Tensors]]:
    staging = None
    if torch.device(opts.device).type == "cuda":
        from weightstream.memory.cuda import CudaStaging

        if opts.gds == "auto":
            log.info("gds='auto': the layered loader reads through the staging ring")
        staging = CudaStaging(opts.device)
    yield from read_layers(store, plan, layers, opts, pinned=pinned, staging=staging)


def _one_by_one(layers: Iterator[tuple[str, Tensors]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each layer's tensors, handed over one at a time: once yielded, a tensor is the caller's alone."""
    with contextlib.closing(layers):
        for _, tensors in layers:
            for name in list(tensors):
                yield name, tensors.pop(name)
