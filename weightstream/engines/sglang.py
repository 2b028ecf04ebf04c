"""The SGLang adapter: ``--load-format weightstream`` (or ``weightstream-<format>``) loads the model's
weights with weightstream, options from ``--model-loader-extra-config``.

The package's ``sglang.srt.plugins`` entry point calls :func:`register` in every SGLang process
(before the CLI parses, in the engine and its scheduler processes): it adds the names to
``--load-format``'s choices and maps each to its loader class when SGLang checks the load format.
From Python, pass the class itself, as SGLang allows::

    from weightstream.engines.sglang import loader_class
    engine = sglang.Engine(model_path="/models/llama", load_format=loader_class("weightstream-layered"))

Command line::

    python -m sglang.launch_server --model-path /models/llama --load-format weightstream-streaming \\
        --model-loader-extra-config '{"uri": "s3://bucket/llama", "threads": 32}'

``uri`` (optional) says where the weights are when not beside the model's config. A Hugging Face
model id (``--model-path org/name``, or ``"uri": "hf://org/name@revision"``) is read from the Hugging
Face cache when it holds the weights, else streamed from the Hub at the commit the revision names
(``HF_HUB_OFFLINE`` and ``--download-dir`` honoured). Every parameter
must be filled, every byte of it (seen from the writes: a fused ``qkv_proj`` missing its ``v`` part
is unfilled): ``WeightsMismatchError`` otherwise, naming them. ``weightstream-layered`` builds the
model with its parameters on the meta device and gives each layer's parameters memory just before
that layer is loaded (SGLang's own ``layered``, with the modules' buffers kept); ``weightstream-sharded-state``
loads into the state dict after the quantization methods' post-processing, as SGLang's ``sharded_state`` does.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

import weightstream
from weightstream.engines import sglang_private
from weightstream.engines.adapter import LoaderSettings, named_for, timed_load
from weightstream.engines.common import (
    check_filled,
    checkpoint_reading,
    engine_formats,
    import_engine,
    load_sharded_state_into,
    sharded_rank,
    weight_batches,
    with_world_group,
)
from weightstream.engines.materialise import materialise, parameters_on_meta
from weightstream.engines.writes import WriteRecorder
from weightstream.errors import UnknownFormatError, logger

INSTALL = "pip install sglang"

log = logger(__name__)


def register() -> None:
    """Add ``engine_formats()``'s names to SGLang's ``--load-format`` choices and map them to their loader
    classes when SGLang checks a load format; SGLang's plugin loader calls it.

    Example:
        >>> from weightstream.engines import sglang
        >>> sglang.register()  # doctest: +SKIP
    """
    choices = import_engine("sglang.srt.arg_groups.choices", INSTALL)
    hooks = import_engine("sglang.srt.plugins.hook_registry", INSTALL)
    choices.add_load_format_choices([name for name in engine_formats() if name not in choices.LOAD_FORMAT_CHOICES])
    hooks.HookRegistry.register(sglang_private.VERIFY_LOAD_FORMAT, _verify_load_format, hooks.HookType.AROUND)


def loader_class(load_format: str = "weightstream") -> type:
    """The SGLang ``BaseModelLoader`` subclass for ``load_format`` (one of ``engine_formats()``), the same
    class at every call; pass it as SGLang's ``load_format``.

    Raises:
        UnknownFormatError: a name that is not one of ours.
        EngineUnavailableError: SGLang is not installed.

    Example:
        >>> loader_class("weightstream-layered").__name__  # doctest: +SKIP
        'WeightstreamModelLoader_weightstream_layered'
    """
    formats = engine_formats()
    if load_format not in formats:
        raise UnknownFormatError(
            f"{load_format!r} is not a weightstream load format; known: {', '.join(sorted(formats))}"
        )
    return _loader_class(load_format, formats[load_format])


def _verify_load_format(original: Any, load_config: Any) -> None:
    name = load_config.load_format
    if isinstance(name, str) and name.lower() in engine_formats():
        load_config.load_format = loader_class(name.lower())
        return None
    return original(load_config)


@functools.cache
def _loader_class(load_format: str, weightstream_format: str) -> type:
    base = import_engine("sglang.srt.model_loader.loader", INSTALL).BaseModelLoader

    class WeightstreamModelLoader(base):  # type: ignore[misc, valid-type]
        __doc__ = f"SGLang's --load-format {load_format}: weightstream's {weightstream_format!r} loader."

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.settings = LoaderSettings(load_config.model_loader_extra_config, load_format)

        def download_model(self, model_config: Any) -> None:
            """Nothing is downloaded (the weights are read where they are); a Hugging Face id is resolved now
            (the cache, or the Hub's commit its revision names), and every later load reads what it resolved to."""
            self._located(model_config)

        def load_model(self, *, model_config: Any, device_config: Any) -> torch.nn.Module:
            uri, options = self._located(model_config)
            with timed_load(log.info, weightstream_format):
                if weightstream_format == "sharded-state":
                    model = _load_sharded_state(self.load_config, model_config, device_config, uri, options)
                elif weightstream_format == "layered":
                    model = _load_layered(self.load_config, model_config, device_config, uri, options)
                else:
                    model = _load_checkpoint(
                        self.load_config, model_config, device_config, uri, weightstream_format, options
                    )
            return model.eval()

        def _located(self, model_config: Any) -> tuple[str, dict[str, Any]]:
            return self.settings.located(model_config.model_path, model_config.revision, self.load_config.download_dir)

    return named_for(WeightstreamModelLoader, load_format)


def _build(load_config: Any, model_config: Any, device: torch.device, *, on_meta: bool = False) -> torch.nn.Module:
    """The model as SGLang's own loaders build it: its quantization config, default dtype, on ``device``."""
    with (
        sglang_private.default_dtype(model_config.dtype),
        device,
        parameters_on_meta() if on_meta else contextlib.nullcontext(),
    ):
        return sglang_private.initialize_model(model_config, load_config)


def _load_checkpoint(
    load_config: Any, model_config: Any, device_config: Any, uri: str, weightstream_format: str, options: dict[str, Any]
) -> torch.nn.Module:
    """Through the model's own ``load_weights`` (its weight loaders shard and fuse), checked, then post-processed."""
    device = _target_device(device_config)
    model = _build(load_config, model_config, device)
    weightstream_format, options = checkpoint_reading(device, uri, weightstream_format, options)
    if weightstream_format == "distributed":
        options = with_world_group(options, sglang_private.parallel_state(), device)
    with (
        sglang_private.default_dtype(model_config.dtype),
        WriteRecorder() as writes,
        weight_batches(uri, weightstream_format, device, options) as batches,
    ):
        for batch in batches:
            model.load_weights(batch)
    _check_and_postprocess(model, model_config, writes, uri, device)
    return model


def _load_layered(
    load_config: Any, model_config: Any, device_config: Any, uri: str, options: dict[str, Any]
) -> torch.nn.Module:
    """Parameters on meta; each layer's parameters get memory just before the layer is loaded (its key is
    its module's path: ``model.layers.3``), one ``load_weights`` call per layer."""
    device = _target_device(device_config)
    model = _build(load_config, model_config, device, on_meta=True)
    layers = weightstream.iter_layers(uri, device=str(device), **options)
    with sglang_private.default_dtype(model_config.dtype), WriteRecorder() as writes, contextlib.closing(layers):
        for key, tensors in layers:
            writes.forget(materialise(model, key, device))
            model.load_weights(list(tensors.items()))
    _check_and_postprocess(model, model_config, writes, uri, device)
    return model


def _check_and_postprocess(
    model: torch.nn.Module, model_config: Any, writes: WriteRecorder, uri: str, device: torch.device
) -> None:
    parameters = dict(model.named_parameters())
    if model_config.quantization is None:
        unfilled = set(writes.unfilled(parameters))
    else:  # quantization methods fill their parameters in ways of their own; one still on meta was never given memory
        unfilled = {name for name, parameter in parameters.items() if parameter.device.type == "meta"}
    check_filled(parameters, set(parameters) - unfilled, uri)
    sglang_private.postprocess_weights(model, device)


def _load_sharded_state(
    load_config: Any, model_config: Any, device_config: Any, uri: str, options: dict[str, Any]
) -> torch.nn.Module:
    """As SGLang's ``sharded_state``: the model built and its quantization methods' post-processing run
    first (the state was saved after it), then this rank's tensors copied into its state dict."""
    device = _target_device(device_config)
    model = _build(load_config, model_config, device)
    for _, module in model.named_modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(module)
    rank, world_size, pattern = sharded_rank(sglang_private.parallel_state())
    state = sglang_private.filter_subtensors(model.state_dict())
    load_sharded_state_into(state, uri, rank=rank, world_size=world_size, pattern=pattern, options=options)
    sglang_private.post_load_weights(model)
    return model


def _target_device(device_config: Any) -> torch.device:
    """SGLang's device, with the current GPU's index where it names none (``cuda``)."""
    device = torch.device(device_config.device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
