"""The OCI source's running blob hash: pieces fed in any order, by many threads, are hashed in blob order; a
blob that does not match its digest is an IntegrityError; pieces the load never reads are reported as gaps."""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.errors import IntegrityError
from weightstream.sources.oci import digest as blob_hash
from weightstream.sources.oci.digest import BlobHash


def pieces(data: bytes, cuts: list[int]) -> list[tuple[int, bytes]]:
    bounds = sorted({0, len(data), *(cut % (len(data) + 1) for cut in cuts)})
    return [(start, data[start:end]) for start, end in itertools.pairwise(bounds) if end > start]


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=1, max_size=4096), st.lists(st.integers(0, 1 << 16), max_size=12), st.randoms())
def test_pieces_fed_in_any_order_by_threads_check_the_blob(data, cuts, order):
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    state = BlobHash(digest, len(data), "blob")
    parts = pieces(data, cuts)
    order.shuffle(parts)
    threads = [threading.Thread(target=state.feed, args=(at, memoryview(piece))) for at, piece in parts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert state.checked and state.hashed_bytes == len(data)


def test_a_corrupted_piece_is_an_integrity_error_naming_the_blob():
    data = os.urandom(10_000)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    state = BlobHash(digest, len(data), "oci://r/m:v1/model.safetensors")
    state.feed(0, memoryview(data[:5000]))
    with pytest.raises(IntegrityError, match=rf"model.safetensors: blob {digest} hashes to sha256:"):
        state.feed(5000, memoryview(b"\0" + data[5001:]))


def test_a_piece_after_a_gap_waits_then_is_set_aside_and_the_gap_is_reported(monkeypatch):
    monkeypatch.setattr(blob_hash, "WAIT_FOR_TURN_S", 0.05)
    data = bytes(range(256)) * 40
    state = BlobHash("sha256:" + hashlib.sha256(data).hexdigest(), len(data), "blob")
    state.feed(0, memoryview(data[:1000]))
    state.feed(4000, memoryview(data[4000:]))  # 1000..4000 is never read by the load
    assert not state.checked
    assert state.gaps(limit=1 << 20) == [(1000, 3000)]
    assert state.gaps(limit=100) == [], "too much left to read: not checked"
    state.feed(1000, memoryview(data[1000:4000]))
    assert state.checked and state.gaps(limit=1 << 20) == []


def test_pieces_overlapping_what_is_hashed_count_once():
    data = os.urandom(3000)
    state = BlobHash("sha256:" + hashlib.sha256(data).hexdigest(), len(data), "blob")
    for at, end in ((0, 2000), (500, 2500), (1000, 3000)):
        state.feed(at, memoryview(data[at:end]))
    assert state.checked


def test_many_threads_without_a_gap_check_a_larger_blob():
    data = os.urandom(1 << 20)
    state = BlobHash("sha256:" + hashlib.sha256(data).hexdigest(), len(data), "blob")
    parts = pieces(data, list(range(0, 1 << 20, 1 << 16)))
    random.Random(3).shuffle(parts)
    threads = [threading.Thread(target=state.feed, args=(at, memoryview(piece))) for at, piece in parts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert state.checked
