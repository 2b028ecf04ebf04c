"""Coalescing and splitting reads: properties that must hold for any set of tensors."""

from __future__ import annotations

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
