"""Every registered loader: bit-exact round trips, filters, and leaks, on every layout it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import weightstream
from tests.conformance.writers import GUARDED_WRITERS, KEEPING_OPTIONS, WRITERS, refuses, running, single_file
from tests.conftest import CPU, assert_same
from weightstream.formats.safetensors import DTYPES


def every_dtype() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    state = {}
    for dtype_name, dtype in DTYPES.items():
        raw = torch.randint(0, 256, (6 * dtype.itemsize,), dtype=torch.uint8, generator=generator)
        if dtype is torch.bool:
            raw = raw % 2
        state[f"dtype.{dtype_name}"] = raw.view(dtype).reshape(2, 3)
    state["scalar.f32"] = torch.tensor(3.25)
    state["scalar.bf16"] = torch.tensor(-1.5, dtype=torch.bfloat16)
    state["empty.f32"] = torch.empty(0, 5)
    state["empty.i64"] = torch.empty(3, 0, dtype=torch.int64)
    state["odd.u8"] = torch.arange(7, dtype=torch.uint8)
    state["after.odd.f64"] = torch.randn(5, dtype=torch.float64, generator=generator)
    return state


def test_every_dtype_scalars_and_empty_tensors(layout, destination, tmp_path: Path, no_leaks):
    name, writer = layout
    state = every_dtype()
    uri = writer(state, tmp_path / "ckpt")
    assert_same(weightstream.load_weights(uri, format=name, **destination.options), state, destination)


def test_header_order_differs_from_offset_order(layout, tmp_path: Path, tiny_state, no_leaks):
    """The header lists tensors in another order than their bytes (rewritten here, reversed)."""
    name, writer = layout
    uri = writer(tiny_state, tmp_path / "ckpt")
    first = min(Path(uri).glob("*.safetensors")) if Path(uri).is_dir() else Path(uri)
    blob = first.read_bytes()
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + length])
    reordered = json.dumps(dict(reversed(header.items()))).encode()
    reordered += b" " * (-len(reordered) % 8)
    first.write_bytes(len(reordered).to_bytes(8, "little") + reordered + blob[8 + length :])
    keys = [key for key in json.loads(reordered) if key != "__metadata__"]
    assert keys != sorted(keys, key=lambda key: header[key]["data_offsets"][0]), "precondition: the orders differ"
    if writer in GUARDED_WRITERS:
        with pytest.raises(
            weightstream.ManifestError, match=r"bytes, the manifest says \d+ \(the file changed after the save\)"
        ):
            weightstream.load_weights(uri, format=name)
        return
    assert_same(weightstream.load_weights(uri, format=name), tiny_state)


IO_MODES = [
    {"direct_io": False, "prefault": False, "huge_pages": False},
    {"direct_io": True},
    {"direct_io": "auto", "prefault": False},
    {"zero_copy": True},
]
IO_IDS = ["buffered-4k", "direct", "auto", "zero-copy"]


@pytest.mark.parametrize("io", IO_MODES, ids=IO_IDS)
def test_llama_checkpoint(layout, io, destination, tmp_path: Path, tiny_state, no_leaks):
    name, writer = layout
    if io.get("zero_copy") and destination is not CPU:
        pytest.skip("zero_copy lands only in pageable CPU memory (refusal tested in test_options)")
    uri = writer(tiny_state, tmp_path / "ckpt")
    options = {**io, **destination.options}
    if refuses(name, options, uri):
        return
    assert_same(weightstream.load_weights(uri, format=name, **options), tiny_state, destination)
    kept = dict(
        weightstream.iter_weights(
            uri, format=name, **{"chunk_bytes": 4096, "threads": 3, **options, **KEEPING_OPTIONS.get(name, {})}
        )
    )
    assert_same(kept, tiny_state, destination)


@pytest.mark.parametrize("io", IO_MODES, ids=IO_IDS)
def test_filter_by_names_and_predicate(layout, io, destination, tmp_path: Path, tiny_state, no_leaks):
    """Runs of wanted bytes separated by unwanted ones: direct reads widen to pages and must not clobber."""
    name, writer = layout
    if io.get("zero_copy") and destination is not CPU:
        pytest.skip("zero_copy lands only in pageable CPU memory (refusal tested in test_options)")
    uri = writer(tiny_state, tmp_path / "ckpt")
    options = {**io, **destination.options}
    if refuses(name, options, uri):
        return
    wanted = [
        "model.layers.1.mlp.up_proj.weight",
        "lm_head.weight",
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
    ]
    assert_same(
        weightstream.load_weights(uri, format=name, filter=wanted, **options),
        {n: tiny_state[n] for n in wanted},
        destination,
    )
    layer_two = {n: t for n, t in tiny_state.items() if ".layers.2." in n}
    assert_same(
        weightstream.load_weights(uri, format=name, filter=lambda n: ".layers.2." in n, **options),
        layer_two,
        destination,
    )


@pytest.mark.parametrize(
    "io", [{"direct_io": True, "chunk_bytes": 4096}, {"zero_copy": True}], ids=["direct", "zero-copy"]
)
def test_every_dtype_read_directly_or_mapped(layout, io, tmp_path: Path, no_leaks):
    name, writer = layout
    state = every_dtype()
    uri = writer(state, tmp_path / "ckpt")
    if refuses(name, io, uri):
        return
    assert_same(weightstream.load_weights(uri, format=name, **io), state)


def test_zero_copy_tensors_are_private(layout, tmp_path: Path, tiny_state, no_leaks):
    """Writing to a zero-copy tensor copies its page: the file and other loads are unchanged."""
    name, writer = layout
    uri = writer(tiny_state, tmp_path / "ckpt")
    if refuses(name, {"zero_copy": True}, uri):
        return
    mapped = weightstream.load_weights(uri, format=name, zero_copy=True)
    mapped["lm_head.weight"].fill_(7)
    assert_same(weightstream.load_weights(uri, format=name), tiny_state)


def test_cold_files_are_read_directly_on_auto(layout, tmp_path: Path, tiny_state, no_leaks):
    from weightstream.sources.local import pagecache
    from weightstream.sources.local.file import LocalStore

    name, writer = layout
    uri = writer(tiny_state, tmp_path / "ckpt")
    paths = sorted(Path(uri).glob("*.safetensors")) if Path(uri).is_dir() else [Path(uri)]
    for path in paths:
        pagecache.drop(str(path))
        with LocalStore().open(str(path), direct="auto") as source:
            assert source.direct
        pagecache.warm(str(path))
        with LocalStore().open(str(path), direct="auto") as source:
            assert not source.direct
        pagecache.drop(str(path))
    assert_same(weightstream.load_weights(uri, format=name), tiny_state)


def test_filter_selecting_nothing(layout, tmp_path: Path, tiny_state, no_leaks):
    name, writer = layout
    uri = writer(tiny_state, tmp_path / "ckpt")
    assert weightstream.load_weights(uri, format=name, filter=lambda n: False) == {}
    assert weightstream.load_weights(uri, format=name, filter=[]) == {}


def test_filter_naming_a_missing_tensor(layout, tmp_path: Path, tiny_state, no_leaks):
    name, writer = layout
    uri = writer(tiny_state, tmp_path / "ckpt")
    with pytest.raises(
        weightstream.TensorNotFound, match=r"1 requested tensor\(s\) not in the checkpoint: 'model.nope'"
    ):
        weightstream.load_weights(uri, format=name, filter=["lm_head.weight", "model.nope"])


def test_tensors_are_owned_memory(layout, tmp_path: Path, tiny_state, no_leaks):
    """Deleting (or rewriting) the files afterwards must not change the loaded tensors."""
    name, writer = layout
    uri = writer(tiny_state, tmp_path / "ckpt")
    loaded = weightstream.load_weights(uri, format=name)
    for path in (tmp_path / "ckpt").iterdir():
        path.write_bytes(b"\xff" * path.stat().st_size)
        path.unlink()
    assert_same(loaded, tiny_state)
    next(iter(loaded.values())).add_(1)  # writable


def test_abandoned_iterator_leaks_nothing(layout, destination, tmp_path: Path, tiny_state, no_leaks):
    name, writer = layout
    uri = writer(tiny_state, tmp_path / "ckpt")
    stream = weightstream.iter_weights(uri, format=name, **{"chunk_bytes": 4096, **destination.options})
    first_name, first = next(stream)
    assert torch.equal(first.cpu().view(torch.uint8), tiny_state[first_name].view(torch.uint8))
    stream.close()


def test_unknown_option_raises_before_any_io(layout, tmp_path: Path):
    name, _ = layout
    with pytest.raises(
        weightstream.OptionError,
        match=r"unknown option\(s\) chunk_size; known options: cache, chunk_bytes, .*; did you mean chunk_bytes\?$",
    ):
        weightstream.iter_weights(tmp_path / "does-not-exist", format=name, chunk_size=1)


@pytest.mark.parametrize("name", [loader for loader, writers in WRITERS.items() if single_file in writers])
def test_every_dtype_as_safetensors_reads_it(name, tmp_path: Path, no_leaks):
    """Each dtype (F8 and F4 kinds included) of a file the ``safetensors`` package writes loads as its own
    ``load_file`` reads it: the same torch dtype, shape and bits."""
    uri = single_file(every_dtype(), tmp_path / "ckpt")
    with running(name, tmp_path):
        assert_same(weightstream.load_weights(uri, format=name, **KEEPING_OPTIONS.get(name, {})), load_file(uri))


def test_every_dtype_sliced_as_safetensors_slices_it(tmp_path: Path, no_leaks):
    """``get_slice`` of every dtype gives what safetensors' own gives; for F4, whose slices safetensors 0.8 cannot
    take (it counts values where torch counts pairs), what indexing the bits of ``load_file``'s tensor gives."""
    uri = single_file(every_dtype(), tmp_path / "ckpt")
    whole = load_file(uri)
    indexes = [(slice(None), slice(1, 3)), 1, (Ellipsis, 0), [1, 0]]
    with weightstream.open(uri) as ours, safe_open(uri, "pt") as theirs:
        for tensor in whole:
            for index in indexes if ours.get_slice(tensor).shape[:1] == (2,) else [(Ellipsis,)]:
                expected = (
                    whole[tensor].view(torch.uint8)[index].view(torch.float4_e2m1fn_x2)
                    if whole[tensor].dtype == torch.float4_e2m1fn_x2
                    else theirs.get_slice(tensor)[index]
                )
                assert_same({tensor: ours.get_slice(tensor)[index]}, {tensor: expected})
