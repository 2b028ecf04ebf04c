"""The ``layered`` loader: layer by layer, in layer order, through a few reused buffers."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import ClassVar

import torch

from weightstream.errors import InvalidOptionError, OptionError, logger
from weightstream.options import LoadOptions, is_int
from weightstream.planning.layers import Layer, LayerRule, compile_rule, group_layers
from weightstream.planning.plan import LoadPlan
from weightstream.planning.planner import read_plan
from weightstream.readers.destination import COPYING_ROUTES, Destination, Route, choose_destination
from weightstream.readers.layered import LayerHook, LayerReading, Tensors, read_layers
from weightstream.sources import Store

log = logger(__name__)


@dataclasses.dataclass(frozen=True)
class LayeredOptions:
    """The ``layered`` loader's own options."""

    prefetch_layers: int = 1
    """Layers read ahead of the one the caller holds. It keeps ``prefetch_layers + 1`` buffers of the
    largest layer's size and reuses them. Default 1."""

    layer_rule: LayerRule | None = None
    """Which layer each tensor belongs to: a regular expression whose first group captures the layer
    number, or a callable name -> layer key (see ``weightstream.planning.layers``). Default ``None``:
    Llama/Qwen/Mistral naming (``model.layers.<n>.``)."""

    layer_hook: LayerHook | None = None
    """``hook(key, tensors)``, called with each complete layer before it is yielded, in layer order;
    what it returns (e.g. quantized tensors and their scales) is yielded instead, ``None`` yields the
    layer as read. Default ``None``."""

    copy_layers: bool = False
    """Yield copies the caller may keep, instead of views of the reused buffers (which must be
    released before the layer after next is asked for). Default ``False``."""

    def __post_init__(self) -> None:
        if not is_int(self.prefetch_layers) or self.prefetch_layers < 1:
            raise InvalidOptionError(f"prefetch_layers must be a positive integer, got {self.prefetch_layers!r}")
        if self.layer_hook is not None and not callable(self.layer_hook):
            raise OptionError(f"layer_hook must be callable, got {type(self.layer_hook).__name__}")
        if not isinstance(self.copy_layers, bool):
            raise OptionError(f"copy_layers must be a bool, got {type(self.copy_layers).__name__}")
        if self.layer_rule is not None:
            object.__setattr__(self, "layer_rule", compile_rule(self.layer_rule))

    @property
    def rule(self) -> re.Pattern[str] | Callable[[str], str] | None:
        """The layer rule, compiled."""
        return self.layer_rule  # type: ignore[return-value]  # compiled in __post_init__

    def reading(self) -> LayerReading:
        """What the reader needs of these options."""
        return LayerReading(self.prefetch_layers, self.copy_layers, self.layer_hook)


class LayeredLoader:
    """Reads safetensors checkpoints one layer at a time, embeddings first, then ``layers.0``,
    ``layers.1``, ..., then the final norm and the head (``layer_rule`` says what a layer is).

    Memory: ``prefetch_layers + 1`` buffers of the largest layer's size, allocated once and reused
    (plus the staging ring on a GPU), whatever the size of the checkpoint. Yielded tensors are views
    of those buffers: when asking for a layer the caller may still hold at most ``prefetch_layers``
    earlier layers (else ``LayerInUseError``), or it passes ``copy_layers=True`` and keeps copies.
    """

    name: ClassVar[str] = "layered"
    options: ClassVar[type] = LayeredOptions
    reuses_memory: ClassVar[bool] = True
    """Yielded tensors share buffers that later layers reuse: ``load_weights``, which keeps them all, asks for copies
    (``copy_layers=True``)."""

    def check(self, opts: LoadOptions) -> None:
        """Nothing beyond its own options' checks (the routes: :func:`choose_destination`)."""

    def plan(self, store: Store, uri: str, opts: LoadOptions) -> LoadPlan:
        choose_destination(store, uri, opts, self.name, COPYING_ROUTES)
        plan = read_plan(store, uri, opts.wants, opts.required)
        group_layers(
            plan.tensors, opts.own(LayeredOptions).rule
        )  # a rule that fails on a name fails here, before any read
        return plan

    def iter_layers(self, store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, Tensors]]:
        """Yield ``(layer key, {name: tensor})`` for each layer of ``plan``, in layer order."""
        destination = choose_destination(store, plan.uri, opts, self.name, COPYING_ROUTES)
        layers = group_layers(plan.tensors, opts.own(LayeredOptions).rule)
        return _read(store, plan, layers, opts, destination)

    def iter_weights(self, store: Store, plan: LoadPlan, opts: LoadOptions) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of :meth:`iter_layers`, one by one: layer after layer, each in stored order."""
        return _one_by_one(self.iter_layers(store, plan, opts))


def _read(
    store: Store, plan: LoadPlan, layers: list[Layer], opts: LoadOptions, destination: Destination
) -> Iterator[tuple[str, Tensors]]:
    staging = None
    if destination.route is Route.STAGED:
        from weightstream.memory.cuda import CudaStaging

        staging = CudaStaging(destination.device)
    yield from read_layers(
        store, plan, layers, opts, opts.own(LayeredOptions).reading(), pinned=destination.pinned, staging=staging
    )


def _one_by_one(layers: Iterator[tuple[str, Tensors]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each layer's tensors, handed over one at a time: once yielded, a tensor is the caller's alone."""
    with contextlib.closing(layers):
        for _, tensors in layers:
            for name in list(tensors):
                yield name, tensors.pop(name)
