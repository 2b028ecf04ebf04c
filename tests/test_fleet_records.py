"""The fleet's records as read from etcd: every kind parses what the fleet writes back to the same record, and
anything else (any bytes, any key name) either parses to a record that passes the schema's checks or raises
UnparsableRecord, never another exception; a store skips and counts what does not parse."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.etcd_server import etcd_server
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway
from weightstream.nodecache.daemon.fleet.record_store import UNPARSABLE_CLAIM, RecordStore
from weightstream.nodecache.daemon.fleet.records import (
    NAME,
    SHA256,
    Claim,
    FleetKeys,
    NodeRecord,
    Offer,
    UnparsableRecord,
    parse_claim,
    parse_digest,
    parse_node,
    parse_offer,
    parse_plan,
    parse_reason,
)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> str:
    with etcd_server(tmp_path_factory.mktemp("etcd")) as url:
        yield url


PARSERS = [parse_claim, parse_offer, parse_node, parse_digest, parse_plan]

names = st.from_regex(NAME, fullmatch=True).filter(lambda name: len(name) < 60)
digests = st.from_regex(SHA256, fullmatch=True)
claims = st.builds(Claim, names, st.just("claimed"), st.none()) | st.builds(Claim, names, st.just("done"), digests)
offers = st.builds(
    Offer,
    st.integers(0, (1 << 64) - 1),
    st.integers(0, 1 << 50),
    st.sampled_from(["DRAM", "VRAM"]),
    st.integers(0, 16),
    st.binary(max_size=64).map(bytes.hex),
    st.none() | names,
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
field_names = st.sampled_from(["node", "state", "sha256", "address", "size", "memory", "device", "metadata", "gpu"])
near_records = st.dictionaries(field_names, json_values, max_size=9).map(lambda record: json.dumps(record).encode())


@settings(max_examples=200, deadline=None)
@given(claims)
def test_a_claim_reads_back_as_written(claim: Claim):
    assert parse_claim(claim.encode()) == claim


@settings(max_examples=200, deadline=None)
@given(offers)
def test_an_offer_reads_back_as_written(offer: Offer):
    assert parse_offer(offer.encode()) == offer


@settings(max_examples=100, deadline=None)
@given(names, digests, st.integers(1 << 20, 1 << 30))
def test_the_other_records_read_back_as_written(node: str, sha256: str, piece_bytes: int):
    assert parse_node(NodeRecord(node).encode()) == NodeRecord(node)
    assert parse_digest(sha256.encode()) == sha256
    assert parse_plan(str(piece_bytes).encode()) == piece_bytes


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300) | near_records | json_values.map(lambda value: json.dumps(value).encode()))
def test_any_value_parses_to_a_checked_record_or_raises_unparsable(value: bytes):
    for parse in PARSERS:
        try:
            record = parse(value)
        except UnparsableRecord:
            continue
        if isinstance(record, Claim):
            assert NAME.fullmatch(record.node) and record.state in ("claimed", "done")
            assert record.sha256 is None or SHA256.fullmatch(record.sha256)
        elif isinstance(record, Offer):
            assert type(record.address) is int and type(record.size) is int and record.memory in ("DRAM", "VRAM")
            bytes.fromhex(record.metadata)
        elif isinstance(record, int):
            assert record >= 0
    assert isinstance(parse_reason(value), str)


def test_deep_nesting_and_wrong_types_are_unparsable_not_a_crash():
    for value, parse, why in [
        (b"[" * 100_000, parse_claim, "not JSON"),
        (b"\xff\xfe", parse_offer, "not JSON"),
        (b'["node"]', parse_claim, "a JSON list, not an object"),
        (b'{"node": "a/b", "state": "claimed"}', parse_claim, "node is not a name"),
        (b'{"node": "a", "state": "done", "sha256": "AB"}', parse_claim, "sha256 is not 64 hex digits"),
        (b'{"address": true, "size": 1, "metadata": ""}', parse_offer, "address is not an integer"),
        (b'{"address": 1, "size": 1, "metadata": "zz"}', parse_offer, "metadata is not hex"),
        (b'{"address": 1, "size": 1, "metadata": "", "gpu": 7}', parse_offer, "gpu is not a name"),
        (b"1e9", parse_plan, "not a decimal"),
        (b"4096", parse_plan, "not a decimal in 1048576..1073741824"),
        (b"-1", parse_plan, "not a decimal"),
        (b"\xd9\xa3", parse_plan, "not a decimal"),  # an Arabic-Indic digit: isdigit() in str, not in bytes
    ]:
        with pytest.raises(UnparsableRecord, match=why):
            parse(value)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_any_key_name_gives_names_or_raises_unparsable(tail: str):
    keys = FleetKeys("/fleet")
    under = keys.claims("entry")
    for count in (1, 2, 3):
        try:
            parts = FleetKeys.names(under, under + tail, count)
        except UnparsableRecord:
            continue
        assert len(parts) == count and all(NAME.fullmatch(part) for part in parts) and "/".join(parts) == tail
    try:
        assert 0 <= FleetKeys.piece(under, under + tail) < 10**9
    except UnparsableRecord:
        pass


def test_a_store_skips_counts_and_logs_once_what_does_not_parse(etcd: str, caplog: pytest.LogCaptureFixture):
    gateway = EtcdGateway([etcd])
    store = RecordStore(gateway, "/records")
    good = Claim("node-a", "done", "ab" * 32)
    gateway.put(store.keys.claim("e1", 0), good.encode())
    gateway.put(store.keys.claim("e1", 1), b"{not json")
    gateway.put(store.keys.claims("e1") + "x/y", good.encode())
    gateway.put(store.keys.claims("e1") + "\udcff", good.encode())  # a key that is not UTF-8
    gateway.put(store.keys.digest("e1", 0), b"ab" * 32)
    gateway.put(store.keys.digest("e1", 1), b"not a digest")
    gateway.put(store.keys.plan("e1"), b"{}")
    gateway.put(store.keys.complete("e1", "node-a"), b"[]")
    with caplog.at_level(logging.WARNING, logger="weightstream"):
        for _ in range(2):
            claims = store.claims("e1")
            assert claims == {0: (good, claims[0][1]), 1: (UNPARSABLE_CLAIM, claims[1][1])}  # held, to take over
            assert store.digests("e1") == {0: "ab" * 32}
            assert store.plan("e1") is None
            assert store.holders("e1") == []
    assert store.bad_records == 2 * (3 + 1 + 1 + 1)
    skipped = [record.getMessage() for record in caplog.records if "skipped" in record.getMessage()]
    assert len(skipped) == 6, skipped  # each bad key logged once
    assert any("\\udcff" in line for line in skipped), skipped  # escaped, as ascii() writes it
    gateway.delete_prefix("/records/")
