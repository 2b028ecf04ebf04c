"""Runs in the SGLang environment (``tests/engine_envs.py``): ``python -m tests.sglang_check CASES_JSON``.

The real ``sglang`` package, on the CPU, as a single rank (gloo): its plugin loader runs our entry
point, its CLI parses the arguments, its ``get_model_loader`` picks the loader and its own model
classes are built and filled. No SGLang engine runs (its kernels need a GPU); what each case
compares is the model's parameters and buffers against SGLang's own ``auto`` loader, bit for bit.
Prints one JSON line: each case's result.

PyPI's torchvision cannot load beside the CPU torch (``operator torchvision::nms does not exist``),
and SGLang's multimodal modules import it when its loader module is imported: after transformers
has recorded that torchvision is absent, empty ``torchvision`` modules stand in for it. Nothing
here calls torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from typing import Any

from tests.engine_run import adapters_said, make_cold


class _EmptyModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__module__": self.__name__})


class _EmptyTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _EmptyModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


def start_sglang(model: str, port: int) -> None:
    """Plugins loaded (ours among them), one gloo rank, the parallel context SGLang's layers read."""
    from transformers.utils import import_utils

    assert import_utils.is_torchvision_available() is False
    sys.meta_path.insert(0, _EmptyTorchvision())
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}"
    )
    reset_context()
    publish(ServerArgs(model_path=model, device="cpu"), role="test", ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")


def parse_cli(arguments: list[str]) -> dict:
    """What SGLang's CLI makes of ``arguments``, and the loader its ``get_model_loader`` returns for them."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(arguments)
    load_config = LoadConfig(
        load_format=server_args.load_format, model_loader_extra_config=server_args.model_loader_extra_config
    )
    loader = get_model_loader(load_config)
    settings = getattr(loader, "settings", None)  # SGLang's own loaders have none
    return {
        "load_format": str(server_args.load_format),
        "loader": type(loader).__name__,
        "loader_module": type(loader).__module__,
        "options": settings and settings.options,
        "uri": settings and settings.uri,
    }


def load(case: dict):
    """The model SGLang builds for ``case`` (``load_format``: a name, or ``class:<name>`` for our class passed
    directly): its loader's class name and its parameters and buffers."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    from weightstream.engines.sglang import loader_class

    if case.get("cold"):
        make_cold(case["model"])
    load_format = case["load_format"]
    if load_format.startswith("class:"):
        load_format = loader_class(load_format.removeprefix("class:"))
    load_config = LoadConfig(load_format=load_format, model_loader_extra_config=case.get("extra", {}))
    model_config = ModelConfig(case["model"], dtype="float32")
    loader = get_model_loader(load_config, model_config)
    model = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return type(loader).__name__, {name: tensor.detach().clone() for name, tensor in tensors.items()}


def save_state(model_directory: str, directory: str, writer: str) -> None:
    """The state of the model SGLang's ``auto`` builds, saved by ``writer`` (``weightstream`` or ``sglang``) as rank 0
    of 1."""
    import shutil

    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import ShardedStateLoader, get_model_loader

    import weightstream

    model_config = ModelConfig(model_directory, dtype="float32")
    model = get_model_loader(LoadConfig(load_format="auto"), model_config).load_model(
        model_config=model_config, device_config=DeviceConfig("cpu")
    )
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(model_directory):
        if name.endswith(".json"):
            shutil.copy(os.path.join(model_directory, name), directory)
    if writer == "weightstream":
        weightstream.save_sharded_state(
            ShardedStateLoader._filter_subtensors(model.state_dict()), directory, rank=0, world_size=1
        )
    else:
        ShardedStateLoader.save_model(model, directory)


def main() -> None:
    import torch

    request = json.loads(sys.argv[1])
    start_sglang(request["model"], request["port"])
    results: dict[str, Any] = {}
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES

    results["choices"] = [name for name in LOAD_FORMAT_CHOICES if name.startswith("weightstream")]
    for name, arguments in request.get("cli", {}).items():
        results[name] = _outcome(lambda arguments=arguments: parse_cli(arguments))
    for name, (directory, writer) in request.get("save", {}).items():
        results[name] = _outcome(
            lambda directory=directory, writer=writer: save_state(request["model"], directory, writer)
        )
    reference = None
    for name, case in request["cases"].items():
        try:
            with adapters_said() as said:
                loader, tensors = load(case)
        except Exception as error:  # noqa: BLE001 - reported to the test, which asserts the type and message
            results[name] = {"error": [type(error).__name__, str(error)]}
            continue
        if reference is None:
            reference = tensors
        results[name] = {
            "loader": loader,
            "names": sorted(tensors),
            "differ": sorted(
                key for key in reference if key not in tensors or not torch.equal(reference[key], tensors[key])
            ),
            "extra": sorted(set(tensors) - set(reference)),
            "said": said,
        }
    print(json.dumps(results))


def _outcome(action) -> dict:
    try:
        return {"value": action()}
    except BaseException as error:  # noqa: BLE001 - argparse exits with SystemExit on a bad choice
        return {"error": [type(error).__name__, str(error)]}


if __name__ == "__main__":
    main()
