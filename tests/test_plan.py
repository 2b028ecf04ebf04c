"""Coalescing and splitting reads: properties that must hold for any set of tensors."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.planning.plan import PAGE, TensorSpec, layout_file


@st.composite
def tensor_runs(draw):
    """Tensors laid end to end in a file, some of them skipped (filtered out)."""
    offset = draw(st.integers(0, 10_000))
    kept = []
    for number in range(draw(st.integers(0, 30))):
        size = draw(st.integers(0, 50_000))
        if draw(st.booleans()):
            kept.append(TensorSpec(f"t{number}", torch.uint8, (size,), "f", offset, size))
        offset += size
    return kept


@settings(max_examples=300, deadline=None)
@given(tensor_runs(), st.sampled_from([4096, 8192, 65536]))
def test_requests_read_exactly_the_wanted_bytes(tensors, chunk_bytes):
    layout = layout_file(tensors, chunk_bytes)
    wanted = set()
    for spec in tensors:
        wanted.update(range(spec.offset, spec.end))
    read = []
    for request in layout.requests:
        assert 0 < request.nbytes <= chunk_bytes
        read.extend(range(request.offset, request.offset + request.nbytes))
    assert len(read) == len(set(read)), "a byte is read twice"
    assert set(read) == wanted
    destinations = {spec.name: offset for spec, offset in layout.tensor_offsets}
    for spec, needed in zip([s for s, _ in layout.tensor_offsets], layout.tensor_requests):
        covered = set()
        for number in needed:
            request = layout.requests[number]
            # the request lands where the tensor's own placement says its bytes are
            assert request.dest_offset - destinations[spec.name] == request.offset - spec.offset
            covered.update(range(max(spec.offset, request.offset), min(spec.end, request.offset + request.nbytes)))
        assert covered == set(range(spec.offset, spec.end))
    for spec, offset in layout.tensor_offsets:
        assert offset % PAGE == spec.offset % PAGE
        assert offset + spec.nbytes <= layout.buffer_bytes
    assert layout.buffer_bytes % PAGE == 0
    for first, second in zip(layout.requests, layout.requests[1:]):
        if first.offset + first.nbytes != second.offset:  # different runs never share a destination page
            assert (first.dest_offset + first.nbytes - 1) // PAGE < second.dest_offset // PAGE


def test_adjacent_tensors_coalesce_into_one_request():
    specs = [TensorSpec(f"t{i}", torch.float32, (256,), "f", 64 + i * 1024, 1024) for i in range(4)]
    layout = layout_file(specs, 1 << 20)
    assert [(r.offset, r.nbytes) for r in layout.requests] == [(64, 4096)]


@settings(max_examples=300, deadline=None)
@given(
    tensor_runs(), tensor_runs(), st.sampled_from([4096, 65536]), st.one_of(st.none(), st.sampled_from([4096, 20_000]))
)
def test_streaming_batches_hold_every_tensor_once_and_a_small_lead_first(first, second, chunk_bytes, lead_bytes):
    from weightstream.planning.plan import LoadPlan
    from weightstream.readers.streaming import plan_batches

    second = [dataclasses.replace(spec, name=f"b{spec.name}", file="g") for spec in second]
    plan = LoadPlan("m", (), tuple(first + second))
    batches = plan_batches(plan, chunk_bytes, lead_bytes)
    names = [spec.name for batch in batches for spec, _ in batch.layout.tensor_offsets]
    assert sorted(names) == sorted(spec.name for spec in first + second)
    for batch in batches:
        specs = [spec for spec, _ in batch.layout.tensor_offsets]
        assert len(specs) == 1 or sum(spec.nbytes for spec in specs) <= chunk_bytes
        assert {spec.file for spec in specs} == {"f" if batch.file == 0 and first else "g"}
    leading = first or second  # the plan's first file
    lead_bytes = None if lead_bytes is None else min(lead_bytes, chunk_bytes)
    if lead_bytes is not None and any(spec.nbytes <= lead_bytes for spec in leading):
        lead = [spec for spec, _ in batches[0].layout.tensor_offsets]  # the first run of small tensors, ahead
        start = next(n for n, spec in enumerate(leading) if spec.nbytes <= lead_bytes)
        assert lead == leading[start : start + len(lead)]
        assert sum(spec.nbytes for spec in lead) <= lead_bytes
        end = start + len(lead)
        assert end == len(leading) or sum(spec.nbytes for spec in leading[start : end + 1]) > lead_bytes
    else:  # file order
        assert names == [spec.name for spec in first + second]


def test_a_checkpoint_that_starts_with_its_embedding_streams_a_small_tensor_first():
    from weightstream.planning.plan import LoadPlan
    from weightstream.readers.streaming import plan_batches

    sizes = {"embed": 125 << 20, "norm": 4096, "q": 8 << 20, "k": 2 << 20, "mlp": 22 << 20}
    specs, offset = [], 8
    for name, size in sizes.items():
        specs.append(TensorSpec(name, torch.uint8, (size,), "f", offset, size))
        offset += size
    batches = plan_batches(LoadPlan("m", (), tuple(specs)), 64 << 20, lead_bytes=8 << 20)
    assert [[spec.name for spec, _ in batch.layout.tensor_offsets] for batch in batches] == [
        ["norm"],
        ["embed"],
        ["q", "k", "mlp"],
    ]
