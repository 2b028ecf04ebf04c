"""A model built with its parameters on the meta device and its buffers real, then each parameter
given memory on its device just before its layer is loaded: what the layered adapters build on.

Building under ``torch.device("meta")`` (SGLang's own ``layered``) puts buffers on meta as well, and
``to_empty`` then hands them uninitialised memory: a rotary embedding's ``cos_sin_cache``, computed
in ``__init__`` and in no checkpoint, comes out as garbage. Here each parameter moves to meta as it is
registered, so the modules' own buffers keep the values ``__init__`` gave them; the parameter
object stays the same (modules, tied heads and weight loaders hold it), with its class and attributes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def move_parameter(parameter: torch.Tensor, device: torch.device | str) -> None:
    """Give ``parameter`` uninitialised memory on ``device`` (meta: none), in place: the same object,
    class and attributes (``weight_loader``, ...), its old memory released.

    Example:
        >>> weight = torch.nn.Parameter(torch.zeros(2, 2))
        >>> weight.weight_loader = "kept"
        >>> move_parameter(weight, "meta")
        >>> weight.device, weight.weight_loader, type(weight).__name__
        (device(type='meta'), 'kept', 'Parameter')
    """
    kind, attributes = type(parameter), dict(parameter.__dict__)
    replacement = torch.empty_like(parameter, device=device).requires_grad_(parameter.requires_grad)
    torch.utils.swap_tensors(parameter, replacement)
    parameter.__class__ = kind
    parameter.__dict__.update(attributes)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within: every parameter registered on a module moves to the meta device (buffers stay where they
    are made). Patches ``torch.nn.Module.register_parameter`` for the duration: build models in one thread.

    Example:
        >>> with parameters_on_meta():
        ...     layer = torch.nn.Linear(4, 4)
        >>> layer.weight.device
        device(type='meta')
    """
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, parameter: torch.nn.Parameter | None) -> None:
        register(module, name, parameter)
        if parameter is not None and parameter.device.type != "meta":
            move_parameter(parameter, "meta")

    torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def materialise(model: torch.nn.Module, prefix: str, device: torch.device) -> list[torch.nn.Parameter]:
    """Give every meta parameter of ``model`` under ``prefix`` (a module path, e.g. ``model.layers.3``)
    memory on ``device``, tied aliases included; returns them.

    Example:
        >>> with parameters_on_meta():
        ...     model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> len(materialise(model, "1", torch.device("cpu"))), model[0].weight.device, model[1].weight.device
        (2, device(type='meta'), device(type='cpu'))
    """
    moved = []
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if parameter.device.type == "meta" and (not prefix or name.startswith(prefix + ".")):
            move_parameter(parameter, device)
            moved.append(parameter)
    return moved
