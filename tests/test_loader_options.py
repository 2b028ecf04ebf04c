"""Options of one loader: declared by the loader as a dataclass, validated before any I/O, refused by
the other loaders, given to a third-party loader like to a built-in, and listed in one generated table."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import save_file

import weightstream
from weightstream import registry
from weightstream.errors import InvalidOptionError, OptionError
from weightstream.options import LoadOptions, is_int
from weightstream.options_table import BEGIN, END, field_docs, option_rows, options_table
from weightstream.planning.planner import read_plan
from weightstream.readers.destination import choose_destination
from weightstream.readers.parallel import read_tensors

API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"


@dataclasses.dataclass(frozen=True)
class ScaleOptions:
    factor: int = 1
    """What every tensor is multiplied by. Default 1."""

    def __post_init__(self) -> None:
        if not is_int(self.factor) or self.factor < 1:
            raise InvalidOptionError(f"factor must be a positive integer, got {self.factor!r}")


class ScalingLoader:
    """A third-party loader with an option of its own: the safetensors plan, every tensor times ``factor``."""

    name: ClassVar[str] = "scaled-test"
    options: ClassVar[type] = ScaleOptions

    def check(self, opts: LoadOptions) -> None:
        opts.own(ScaleOptions)

    def plan(self, store, uri, opts):
        return read_plan(store, uri, opts.wants, opts.required)

    def iter_weights(self, store, plan, opts) -> Iterator[tuple[str, torch.Tensor]]:
        factor = opts.own(ScaleOptions).factor
        for name, tensor in read_tensors(store, plan, opts, choose_destination(store, plan.uri, opts, self.name)):
            yield name, tensor * factor


@pytest.fixture
def scaled_loader(monkeypatch):
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    weightstream.register_loader("scaled-test", ScalingLoader)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_file({"model.layers.0.w": torch.arange(6, dtype=torch.int32)}, str(tmp_path / "model.safetensors"))
    return tmp_path / "model.safetensors"


def test_a_third_party_loader_receives_its_own_option(scaled_loader, checkpoint, no_leaks):
    loaded = weightstream.load_weights(checkpoint, format="scaled-test", factor=3, threads=2)
    assert loaded["model.layers.0.w"].tolist() == [0, 3, 6, 9, 12, 15]
    assert weightstream.load_weights(checkpoint, format="scaled-test")["model.layers.0.w"].tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]


def test_a_third_party_option_is_validated_by_its_dataclass_before_any_io(scaled_loader, tmp_path, no_leaks):
    with pytest.raises(InvalidOptionError, match=r"factor must be a positive integer, got 0"):
        weightstream.load_weights(tmp_path / "absent.safetensors", format="scaled-test", factor=0)


def test_the_other_loaders_refuse_a_third_party_option(scaled_loader, checkpoint, no_leaks):
    with pytest.raises(
        InvalidOptionError,
        match=r"factor: an option of format='scaled-test'; format='auto' \(safetensors or streaming or sharded-state\) "
        r"does not use it",
    ):
        weightstream.load_weights(checkpoint, factor=2)
    with pytest.raises(
        InvalidOptionError, match=r"factor: an option of format='scaled-test'; the layered loader does not use it"
    ):
        weightstream.load_weights(checkpoint, format="layered", factor=2)


def test_an_option_no_loader_knows_is_refused_before_any_io(tmp_path, no_leaks):
    with pytest.raises(
        OptionError,
        match=r"unknown option\(s\) prefetch_layer; known options: .*zero_copy; options of the loaders format='auto' "
        r"picks from \(safetensors, streaming, sharded-state\): max_inflight_bytes, rank, shard_pattern, verify, "
        r"world_size; did you mean prefetch_layers \(an option of format='layered'\)\?$",
    ):
        weightstream.load_weights(tmp_path / "absent", prefetch_layer=2)


def test_an_unknown_option_for_a_named_loader_lists_its_options(scaled_loader, checkpoint):
    with pytest.raises(OptionError, match=r"unknown option\(s\) scale; known options: .*; options of the scaled-test "
                       r"loader: factor; did you mean"):  # fmt: skip
        weightstream.load_weights(checkpoint, format="scaled-test", scale=2)


def test_an_engines_unknown_option_lists_only_what_its_extra_config_may_set():
    """Inside an engine, the options the engine decides (device, rank, world_size...) are not offered."""
    from weightstream.engines.common import loader_options

    with pytest.raises(OptionError) as refused:
        loader_options({"thread": 2}, "weightstream")
    offered = str(refused.value).split("known options: ")[1]
    assert "threads" in offered and "max_inflight_bytes" in offered
    assert not {"device", "rank", "world_size"} & set(re.findall(r"\w+", offered)), offered


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"max_inflight_bytes": 0},
            InvalidOptionError,
            r"max_inflight_bytes must be a positive integer or None, got 0",
        ),
        (
            {"max_inflight_bytes": 1.5e9},
            InvalidOptionError,
            r"max_inflight_bytes must be a positive integer or None, got 1500000000.0",
        ),
        (
            {"max_inflight_bytes": 1 << 20, "chunk_bytes": 8 << 20},
            InvalidOptionError,
            r"max_inflight_bytes=1048576 is less than chunk_bytes=8388608: not even one read request would fit",
        ),
        (
            {"format": "safetensors", "max_inflight_bytes": 1 << 30},
            InvalidOptionError,
            r"max_inflight_bytes: an option of format='streaming'; the safetensors loader does not use it",
        ),
        (
            {"format": "layered", "prefetch_layers": 0},
            InvalidOptionError,
            r"prefetch_layers must be a positive integer, got 0",
        ),
        ({"format": "layered", "copy_layers": 1}, OptionError, r"copy_layers must be a bool, got int"),
        ({"format": "layered", "layer_hook": 3}, OptionError, r"layer_hook must be callable, got int"),
        ({"format": "sharded-state", "verify": "yes"}, OptionError, r"verify must be a bool, got str"),
        (
            {"format": "distributed", "stats": {}},
            InvalidOptionError,
            r"stats must be a weightstream.DistributedStats, got dict",
        ),
    ],
)
def test_bad_loader_options_are_refused_before_any_io(tmp_path, options, error, message, no_leaks):
    options = {"format": "streaming", **options}
    with pytest.raises(error, match=message):
        weightstream.load_weights(tmp_path / "absent.safetensors", **options)


def test_iter_layers_on_another_loaders_checkpoint_refuses_that_loaders_options(checkpoint, no_leaks):
    with (
        weightstream.open(checkpoint, "streaming", max_inflight_bytes=64 << 20) as opened,
        pytest.raises(
            InvalidOptionError,
            match=r"max_inflight_bytes: an option of format='streaming'; iter_layers reads through the layered loader",
        ),
    ):
        opened.iter_layers()
    with weightstream.open(checkpoint, "streaming") as opened:
        assert [key for key, _ in opened.iter_layers()] == ["model.layers.0"]


def test_the_documented_table_is_the_generated_one():
    text = API_DOC.read_text()
    assert text[text.index(BEGIN) : text.index(END) + len(END)] == options_table(), (
        "docs/api.md's options table is stale: run python -m weightstream.options_table docs/api.md"
    )


def test_every_option_says_its_default():
    undocumented = [(name, loader) for name, loader, doc in option_rows() if "default" not in doc.lower()]
    assert undocumented == []


def test_a_registered_loaders_options_join_the_table(scaled_loader):
    assert ("factor", "scaled-test", "What every tensor is multiplied by. Default 1.") in option_rows()
    assert field_docs(ScaleOptions) == {"factor": "What every tensor is multiplied by. Default 1."}


def test_options_are_checked_against_the_chosen_loader_only(checkpoint):
    """Only the loader asked for (or, given options of their own, those ``auto`` picks from) is imported to check
    options: a broken or slow third-party loader costs nothing to a load that does not use it. (``safetensors``, the
    loader of local files, comes with ``import weightstream``.)"""
    script = (
        "import sys, weightstream\n"
        "name, value = sys.argv[3].split('=')\n"
        "weightstream.load_weights(sys.argv[1], format=sys.argv[2], **{name: int(value)})\n"
        "print(sorted(name for name in sys.modules if name.startswith('weightstream.loaders.')))\n"
    )
    found = {}
    for format, option in (("layered", "prefetch_layers=2"), ("auto", "threads=2")):
        result = subprocess.run(
            [sys.executable, "-c", script, str(checkpoint), format, option],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        found[format] = result.stdout.strip()
    assert found == {
        "layered": "['weightstream.loaders.base', 'weightstream.loaders.layered', 'weightstream.loaders.safetensors']",
        "auto": "['weightstream.loaders.base', 'weightstream.loaders.safetensors']",
    }
