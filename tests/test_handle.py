"""weightstream.open: one store and one plan from open to close, tensors and slices read through them."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import weightstream
from tests.conftest import save_hf_sharded
from weightstream import registry
from weightstream.checkpoint import opening, slices
from weightstream.planning.plan import LoadPlan
from weightstream.save.write import write_safetensors
from weightstream.sources.local.file import LocalStore

SLICED = {
    "rows.f32": torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48),
    "cube.bf16": torch.randn(6, 10, 12, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    "four.i16": torch.arange(3 * 4 * 5 * 6, dtype=torch.int16).reshape(3, 4, 5, 6),
    "vector.u8": torch.arange(200, dtype=torch.uint8),
    "scalar.f64": torch.tensor(2.5, dtype=torch.float64),
    "empty.f32": torch.zeros(0, 7),
}


class CountingStore(LocalStore):
    """A local store that counts the bytes read through it, the stores made and closed."""

    made: ClassVar[list[CountingStore]] = []

    def __init__(self) -> None:
        super().__init__()
        self.read_bytes = 0
        self.closed = False
        CountingStore.made.append(self)

    def _counted(self, source):
        read_into = source.read_into  # a local file's read() goes through it

        def counted_read_into(offset, buffer):
            self.read_bytes += len(buffer)
            return read_into(offset, buffer)

        source.read_into = counted_read_into
        return source

    def open(self, uri, *, direct=False):  # open_pinned() opens through it
        return self._counted(super().open(uri, direct=direct))

    def close(self) -> None:
        self.closed = True
        super().close()


@pytest.fixture
def counting(monkeypatch):
    CountingStore.made = []
    monkeypatch.setattr(opening, "locate", lambda uri, *args: (CountingStore(), uri))
    return CountingStore.made


@pytest.fixture(scope="module")
def sliced_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("slices") / "sliced.safetensors"
    write_safetensors(path, SLICED)
    return path


def test_names_metadata_and_tensors(tmp_path: Path, tiny_state, no_leaks):
    uri = save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2)
    with weightstream.open(uri) as checkpoint:
        assert set(checkpoint.keys()) == set(tiny_state)
        assert checkpoint.keys() == [spec.name for spec in checkpoint.plan.tensors]
        assert checkpoint.metadata() == {"format": "pt"}
        assert checkpoint.metadata(checkpoint.plan.files[0].path) == {"format": "pt"}
        assert checkpoint.format == "safetensors"
        name = "model.layers.1.mlp.down_proj.weight"
        assert name in checkpoint
        assert torch.equal(checkpoint.get_tensor(name), tiny_state[name])
        loaded = dict(checkpoint.iter_weights())
        assert loaded.keys() == tiny_state.keys() and all(torch.equal(loaded[n], tiny_state[n]) for n in tiny_state)
        stats = checkpoint.stats
        total = sum(tensor.nbytes for tensor in tiny_state.values())
        assert stats.tensors == len(tiny_state) + 1
        assert stats.tensor_bytes == total + tiny_state[name].nbytes == stats.read_bytes
        assert stats.plan_seconds > 0 and stats.wait_seconds > 0
    assert checkpoint.closed


def test_one_store_from_open_to_close(tmp_path: Path, tiny_state, counting, no_leaks):
    """Headers, tensors, slices and layers all go through the store opened once; closing closes it."""
    uri = save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2)
    with weightstream.open(uri) as checkpoint:
        checkpoint.get_tensor("model.norm.weight")
        checkpoint.get_slice("model.embed_tokens.weight")[:2]
        dict(checkpoint.iter_weights())
        assert sum(1 for _ in checkpoint.iter_layers()) > 2
        assert len(counting) == 1 and not counting[0].closed
    assert counting[0].closed


def test_a_dropped_checkpoint_closes_its_store(tmp_path: Path, tiny_state, counting, no_leaks):
    checkpoint = weightstream.open(save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=1))
    del checkpoint
    gc.collect()
    assert counting[0].closed


def test_get_tensor_reads_only_that_tensor(tmp_path: Path, counting, no_leaks):
    state = {"small": torch.ones(16), "big": torch.zeros(4 << 20, dtype=torch.uint8)}
    path = tmp_path / "two.safetensors"
    write_safetensors(path, state)
    with weightstream.open(path) as checkpoint:
        header_bytes = counting[0].read_bytes
        assert torch.equal(checkpoint.get_tensor("small"), state["small"])
        assert counting[0].read_bytes - header_bytes <= 8192, "more than the tensor's pages were read"


def test_an_unknown_tensor_names_the_closest(tmp_path: Path, tiny_state, no_leaks):
    with weightstream.open(save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=1)) as checkpoint:
        with pytest.raises(
            weightstream.TensorNotFound,
            match=r"no tensor 'model.norm.weigth' among its \d+ selected tensors; did you mean 'model.norm.weight'\?",
        ):
            checkpoint.get_tensor("model.norm.weigth")
        with pytest.raises(weightstream.TensorNotFound, match=r"no tensor 'nothing-like-it'.*tensors$"):
            checkpoint.get_slice("nothing-like-it")


def test_metadata_that_disagrees_between_files_is_an_error(tmp_path: Path, no_leaks):
    write_safetensors(tmp_path / "a.safetensors", {"a": torch.ones(2)}, metadata={"format": "pt", "step": "1"})
    write_safetensors(tmp_path / "b.safetensors", {"b": torch.ones(2)}, metadata={"format": "pt", "step": "2"})
    with weightstream.open(tmp_path) as checkpoint:
        with pytest.raises(
            weightstream.HeaderError,
            match=r"metadata 'step' is '1' in .*a.safetensors and '2' in .*b.safetensors; ask for one file's",
        ):
            checkpoint.metadata()
        assert checkpoint.metadata(str(tmp_path / "b.safetensors")) == {"format": "pt", "step": "2"}
        with pytest.raises(weightstream.TensorNotFound, match=r"'c.safetensors' is not one of its files"):
            checkpoint.metadata("c.safetensors")


def test_close_stops_every_iterator(tmp_path: Path, tiny_state, no_leaks):
    uri = save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2)
    checkpoint = weightstream.open(uri, threads=2, chunk_bytes=4096)
    weights, layers = checkpoint.iter_weights(), checkpoint.iter_layers()
    next(weights), next(layers)
    checkpoint.close()
    for iterator in (weights, layers):
        with pytest.raises(
            weightstream.CheckpointClosedError, match=r"the checkpoint was closed while this iterator was open"
        ):
            next(iterator)
    for use in (
        lambda: checkpoint.get_tensor("model.norm.weight"),
        checkpoint.iter_weights,
        lambda: checkpoint.get_slice("model.norm.weight"),
        checkpoint.keys,
        checkpoint.metadata,
        lambda: "model.norm.weight" in checkpoint,
    ):
        with pytest.raises(weightstream.CheckpointClosedError, match=r"the checkpoint is closed"):
            use()
    assert checkpoint.stats.tensors == 2 and checkpoint.plan.tensors  # what it did stays readable
    checkpoint.close()  # idempotent


def test_iter_weights_closes_the_checkpoint_it_opened(tmp_path: Path, tiny_state, counting, no_leaks):
    uri = save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2)
    assert len(dict(weightstream.iter_weights(uri))) == len(tiny_state)
    stopped = weightstream.iter_layers(uri)
    next(stopped)
    stopped.close()
    assert [store.closed for store in counting] == [True, True]


def test_iter_layers_of_a_checkpoint_opened_for_another_loader_checks_its_options(tmp_path: Path, tiny_state, no_leaks):
    checkpoint = weightstream.open(save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=1), zero_copy=True)
    with checkpoint, pytest.raises(weightstream.InvalidOptionError, match=r"zero_copy=True: maps whole files"):
        checkpoint.iter_layers()


def test_a_file_replaced_after_open_is_not_read(tmp_path: Path, no_leaks):
    path = tmp_path / "one.safetensors"
    write_safetensors(path, {"w": torch.ones(1024)})
    with weightstream.open(path) as checkpoint:
        write_safetensors(tmp_path / "new.safetensors", {"w": torch.full((1024,), 2.0)})
        os.replace(tmp_path / "new.safetensors", path)
        with pytest.raises(weightstream.SourceChangedError, match=r"one.safetensors"):
            checkpoint.get_tensor("w")
        with pytest.raises(weightstream.SourceChangedError, match=r"one.safetensors"):
            checkpoint.get_slice("w")[:10]


def test_load_is_every_tensor_in_stored_order(tmp_path: Path, tiny_state, no_leaks):
    with weightstream.open(save_hf_sharded(tiny_state, tmp_path / "ckpt", shards=2), format="layered") as checkpoint:
        loaded = checkpoint.load()
        assert list(loaded) == checkpoint.keys()
        assert all(torch.equal(loaded[name], tiny_state[name]) for name in tiny_state)


def test_a_third_party_loader_reads_through_the_store_it_is_given(tmp_path: Path, monkeypatch, no_leaks):
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    calls = []

    @registry.register_loader("constant-test")
    class ConstantLoader:
        name = "constant-test"

        def check(self, opts):
            calls.append("check")

        def plan(self, store, uri, opts):
            calls.append(("plan", store.is_dir(uri)))
            return LoadPlan(uri, (), ())

        def iter_weights(self, store, plan, opts):
            calls.append(("read", type(store).__name__))
            yield "answer", torch.tensor(42)

    assert weightstream.load_weights(tmp_path, format="constant-test") == {"answer": torch.tensor(42)}
    assert calls == ["check", ("plan", True), ("read", "LocalStore")]


# Slices


def test_rows_are_one_read_of_exactly_their_bytes(tmp_path: Path, counting, no_leaks):
    rows = torch.randn(4096, 256)
    path = tmp_path / "rows.safetensors"
    write_safetensors(path, {"rows": rows})
    with weightstream.open(path) as checkpoint:
        before = counting[0].read_bytes
        part = checkpoint.get_slice("rows")[1000:1010]
        assert torch.equal(part, rows[1000:1010])
        assert checkpoint.stats.read_bytes == 10 * 256 * 4
        assert counting[0].read_bytes - before == 10 * 256 * 4, "a dim-0 slice read more than its bytes"


def test_strided_selections_read_a_fraction_of_the_tensor(tmp_path: Path, counting, no_leaks):
    big = torch.randn(512, 8192)  # 16 MiB, rows of 32 KiB
    path = tmp_path / "big.safetensors"
    write_safetensors(path, {"big": big})
    with weightstream.open(path) as checkpoint:
        before = counting[0].read_bytes
        every_64th = checkpoint.get_slice("big")[::64, 100:200]
        assert torch.equal(every_64th, big[::64, 100:200])
        assert counting[0].read_bytes - before < big.nbytes // 16, "a strided slice read most of the tensor"
        assert checkpoint.stats.read_bytes < big.nbytes // 16


def test_slice_shape_and_dtype_as_safetensors(sliced_file: Path, no_leaks):
    with weightstream.open(sliced_file) as checkpoint:
        view = checkpoint.get_slice("cube.bf16")
        assert (view.shape, view.dtype, view.get_shape(), view.get_dtype()) == (
            (6, 10, 12),
            torch.bfloat16,
            [6, 10, 12],
            "BF16",
        )
        assert repr(view) == "<weightstream.TensorSlice 'cube.bf16' BF16 [6, 10, 12]>"


@pytest.mark.parametrize(
    "index, error, builtin, message",
    [
        ((0, 0, 0), weightstream.SliceIndexError, IndexError, r"too many indices for a tensor of 2 dimensions: 3"),
        (64, weightstream.SliceIndexError, IndexError, r"index 64 is out of bounds for dimension 0 with size 64"),
        (
            (slice(None), -49),
            weightstream.SliceIndexError,
            IndexError,
            r"index -49 is out of bounds for dimension 1 with size 48",
        ),
        ([3, 64], weightstream.SliceIndexError, IndexError, r"index 64 is out of bounds for dimension 0 with size 64"),
        (1.5, weightstream.SliceIndexError, IndexError, r"only integers, slices .* are valid indices \(got float\)"),
        (
            slice(None, None, -1),
            weightstream.SliceValueError,
            ValueError,
            r"dimension 0: slice step must be a positive integer",
        ),
        (slice(None, None, 0), weightstream.SliceValueError, ValueError, r"dimension 0: slice step must be a positive"),
        (
            slice(1.5, None),
            weightstream.SliceTypeError,
            TypeError,
            r"dimension 0: slice bounds and steps are integers, got 1.5",
        ),
    ],
)
def test_bad_slice_indices_are_refused(sliced_file: Path, index, error, builtin, message, no_leaks):
    """Refused with the built-in type torch raises (callers catch it), inside weightstream's tree, naming the tensor."""
    with weightstream.open(sliced_file) as checkpoint, pytest.raises(error, match=message) as raised:
        checkpoint.get_slice("rows.f32")[index]
    assert isinstance(raised.value, builtin) and isinstance(raised.value, weightstream.WeightstreamError)
    assert str(raised.value).startswith("tensor 'rows.f32' [64, 48]: ")


@pytest.mark.parametrize("index", [[], [[]], ([],), (slice(None), [])])
def test_an_empty_list_index_reads_nothing(sliced_file: Path, index, no_leaks):
    with weightstream.open(sliced_file) as checkpoint:
        got = checkpoint.get_slice("rows.f32")[index]
        assert got.shape == SLICED["rows.f32"][index].shape and checkpoint.stats.read_bytes == 0


def test_verify_refuses_slices(tmp_path: Path, no_leaks):
    weightstream.save_sharded_state({"w": torch.ones(8, 4)}, tmp_path / "state", rank=0, world_size=1)
    with weightstream.open(tmp_path / "state", format="sharded-state", verify=True) as checkpoint:
        assert torch.equal(checkpoint.get_tensor("w"), torch.ones(8, 4))
        with pytest.raises(
            weightstream.InvalidOptionError,
            match=r"verify=True checks whole tensors against their checksums; 'w'\[...\] reads part of one",
        ):
            checkpoint.get_slice("w")


def _part(size: int):
    bound = st.integers(-size - 2, size + 2) | st.none()
    return (
        st.integers(-size, size - 1) | st.builds(slice, bound, bound, st.integers(1, size + 1) | st.none())
        if size
        else st.builds(slice, st.none(), st.none())
    )


def _advanced(size: int):
    """torch's other indexes: integer lists and tensors, masks, ``None``."""
    integers = st.lists(st.integers(-size, size - 1), max_size=4) if size else st.just([])
    return (
        integers
        | integers.map(lambda values: torch.tensor(values, dtype=torch.long))
        | st.lists(st.booleans(), min_size=size, max_size=size).map(torch.tensor)
        | st.none()
    )


@st.composite
def tensor_and_index(draw):
    name = draw(st.sampled_from(sorted(SLICED)))
    shape = SLICED[name].shape
    advanced = draw(st.booleans())
    parts = [
        draw(_part(size) | _advanced(size) if advanced else _part(size))
        for size in shape[: draw(st.integers(0, len(shape)))]
    ]
    if draw(st.booleans()):
        parts.insert(draw(st.integers(0, len(parts))), Ellipsis)
    return name, tuple(parts) if draw(st.booleans()) or len(parts) != 1 else parts[0]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=tensor_and_index(), run_cost=st.sampled_from([0, 64, 1 << 16]))
def test_any_slice_equals_torch_indexing(sliced_file: Path, monkeypatch, case, run_cost):
    """Whatever level the reads are planned at, the result (or the error's built-in type) is the one torch gives,
    and never more bytes are read than the whole tensor."""
    name, index = case
    monkeypatch.setattr(slices, "LOCAL_RUN_COST_BYTES", run_cost)
    try:
        expected = SLICED[name][index]
    except (IndexError, TypeError, ValueError) as refused:  # refused by torch: refused here with the same type
        with weightstream.open(sliced_file) as checkpoint, pytest.raises(type(refused)) as raised:
            checkpoint.get_slice(name)[index]
        assert isinstance(raised.value, weightstream.WeightstreamError)
        return
    with weightstream.open(sliced_file) as checkpoint:
        got = checkpoint.get_slice(name)[index]
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
        assert got.is_contiguous() and got.untyped_storage().nbytes() == got.nbytes
        assert checkpoint.stats.read_bytes <= max(SLICED[name].nbytes, SLICED[name].element_size())


def test_slices_equal_safetensors_get_slice(sliced_file: Path, no_leaks):
    """The indexes safetensors' own ``get_slice`` takes give the same tensors here."""
    indexes = [(slice(2, 9), slice(None, None, 5)), [], [0, 5, 3], (Ellipsis, 1), None, (slice(None), [])]
    with weightstream.open(sliced_file) as ours, safe_open(sliced_file, "pt") as theirs:
        for name in ("rows.f32", "cube.bf16"):
            for index in indexes:
                assert torch.equal(ours.get_slice(name)[index], theirs.get_slice(name)[index]), (name, index)


@pytest.mark.parametrize(
    ("format", "options"),
    [
        ("safetensors", {}),
        ("streaming", {"max_inflight_bytes": 1 << 20, "chunk_bytes": 1 << 16}),
        ("layered", {"layer_hook": lambda key, tensors: {name: tensor * 0 for name, tensor in tensors.items()}}),
    ],
)
def test_a_slice_reads_through_the_checkpoints_loader(tmp_path: Path, format, options, no_leaks):
    """Pieces of a slice go through the loader the checkpoint was opened with (a layered checkpoint's hook, which
    transforms whole layers, is not applied to them), counted once in the stats."""
    tensors = {f"model.layers.{n}.w": torch.randn(64, 32, generator=torch.Generator().manual_seed(n)) for n in range(3)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with weightstream.open(tmp_path / "model.safetensors", format, **options) as checkpoint:
        part = checkpoint.get_slice("model.layers.1.w")[3:9, 5:7]
        assert checkpoint.format == format
        assert torch.equal(part, tensors["model.layers.1.w"][3:9, 5:7])
        assert (checkpoint.stats.tensors, checkpoint.stats.tensor_bytes) == (1, 6 * 2 * 4)


def test_habits_from_safetensors_are_accepted(tmp_path: Path, no_leaks):
    """``framework="pt"`` and a ``torch.device`` (or an integer, as ``cuda:N``) are taken as safetensors takes them;
    a framework weightstream does not return, or one passed where the format goes, is refused naming both."""
    save_file({"w": torch.arange(4.0)}, str(tmp_path / "model.safetensors"))
    with weightstream.open(tmp_path / "model.safetensors", framework="pt", device=torch.device("cpu")) as checkpoint:
        assert checkpoint.options.device == "cpu" and torch.equal(checkpoint.get_tensor("w"), torch.arange(4.0))
    assert weightstream.LoadOptions(device=torch.device("cuda", 1)).device == "cuda:1"
    assert weightstream.LoadOptions(device=0).device == "cuda:0"
    if not torch.cuda.is_available():
        with pytest.raises(weightstream.DeviceUnavailableError, match=r"device 'cuda:0' requested"):
            weightstream.load_weights(tmp_path / "model.safetensors", device=0)
    for framework, format in (("np", "auto"), ("pt", "pt")):
        with pytest.raises(
            weightstream.InvalidOptionError,
            match=rf"framework='{framework}', format='{format}': weightstream returns torch tensors",
        ):
            weightstream.open(tmp_path / "model.safetensors", format, framework=framework)


def test_what_is_not_a_checkpoint_is_named(tmp_path: Path, monkeypatch, no_leaks):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}')
    with pytest.raises(weightstream.HeaderError, match=r"the file starts like JSON text, not a safetensors file"):
        weightstream.load_weights(tmp_path / "config.json")
    (tmp_path / "weights").write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(weightstream.HeaderError, match=r"looks like a zip archive \(torch.save's format"):
        weightstream.load_weights(tmp_path / "weights")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(weightstream.NotFound, match=r"did you mean the Hugging Face model hf://Qwen/Qwen3-0.6B\?"):
        weightstream.load_weights("Qwen/Qwen3-0.6B")


def test_a_loader_whose_plan_is_not_a_plan_is_named(monkeypatch, tmp_path: Path, no_leaks):
    class Planless:
        name: ClassVar[str] = "planless-test"

        def check(self, opts) -> None:
            pass

        def plan(self, store, uri, opts):
            return {"tensors": []}

        def iter_weights(self, store, plan, opts):
            return iter(())

    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    weightstream.register_loader("planless-test", Planless)
    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(TypeError, match=r"format 'planless-test': .*Planless.plan returned a dict, not a .*LoadPlan"):
        weightstream.open(tmp_path / "model.safetensors", "planless-test")
