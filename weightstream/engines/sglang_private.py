"""SGLang's internals that the SGLang adapter uses, all here, with the SGLang they were checked against.

SGLang documents none of these as API (its loader module's helpers, a private static method, the method
that checks ``--load-format``); they may change in any release. ``tests/test_sglang.py`` runs them on every
version in :data:`CHECKED` (the registry's SGLang releases: 0.5.23 only, as of 2026-12). On another version
the first use logs one WARNING naming it, then tries.

Example:
    >>> from weightstream.engines import sglang_private
    >>> sglang_private.CHECKED
    ('0.5.23',)
"""

from __future__ import annotations

import contextlib
import functools
from importlib import metadata
from typing import Any

import torch

from weightstream.engines.adapter import version_checked

CHECKED = ("0.5.23",)
"""The SGLang versions (its distribution's) the uses below were run on."""
VERIFY_LOAD_FORMAT = "sglang.srt.configs.load_config.LoadConfig._verify_load_format"
"""The method SGLang checks ``--load-format`` strings with; the adapter's AROUND hook maps our names to classes."""


@functools.cache
def checked_version() -> bool:
    """Whether the installed SGLang is one of :data:`CHECKED` (a WARNING, once, when not)."""
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return version_checked("SGLang", version, CHECKED, "its model loader's helpers")


def initialize_model(model_config: Any, load_config: Any) -> torch.nn.Module:
    """The model class built as SGLang's own loaders build it, with their quantization config
    (``loader._get_quantization_config``, ``loader._initialize_model``); the caller sets dtype and device."""
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model

    checked_version()
    return _initialize_model(model_config, load_config, _get_quantization_config(model_config, load_config))


def default_dtype(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """SGLang's ``set_default_torch_dtype``, which its loaders build and load under."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    return set_default_torch_dtype(dtype)


def postprocess_weights(model: torch.nn.Module, device: torch.device) -> None:
    """What SGLang's default loader runs after the weights are in (``DefaultModelLoader.postprocess_weights``)."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    DefaultModelLoader.postprocess_weights(model, device)


def post_load_weights(model: torch.nn.Module) -> None:
    """What SGLang's ``sharded_state`` loader runs after copying the state in (``loader.post_load_weights``)."""
    from sglang.srt.model_loader.loader import post_load_weights as post_load

    post_load(model)


def filter_subtensors(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The state dict without views of other tensors in it, as SGLang's ``sharded_state`` saves and loads it
    (``ShardedStateLoader._filter_subtensors``, a private static method)."""
    from sglang.srt.model_loader.loader import ShardedStateLoader

    checked_version()
    return ShardedStateLoader._filter_subtensors(state)


def parallel_state() -> Any:
    """SGLang's ``sglang.srt.distributed.parallel_state`` (its world group, ranks)."""
    from sglang.srt.distributed import parallel_state as state

    return state
