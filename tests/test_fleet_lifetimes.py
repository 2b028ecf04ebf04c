"""Nothing the fleet writes in etcd grows without end: an entry's plan and digests live under a lease of the entry's
own that every node filling or holding it keeps alive; the last holder to evict it (or to leave) deletes them, a
holder that dies takes them with it within their TTL, and a holder that finds them ended publishes them again.
Real etcd, NIXL agents, daemons and node processes."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="the fleet's data plane needs NIXL (pip install 'weightstream[fleet]')")

from safetensors.torch import save_file

import weightstream
from tests.cache_daemon import request
from tests.conftest import assert_same
from tests.etcd_server import etcd_server
from tests.rangeserver import RangeServer, replace_file
from tests.test_fleet_daemons import fleet_of
from tests.test_fleet_fill import PIECE, Node
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> str:
    with etcd_server(tmp_path_factory.mktemp("etcd")) as url:
        yield url


def families(gateway: EtcdGateway, prefix: str) -> dict[str, int]:
    """How many keys of each family the fleet at ``prefix`` holds."""
    counts: dict[str, int] = {}
    for key in gateway.get_prefix(prefix + "/"):
        family = key[len(prefix) + 1 :].split("/", 1)[0]
        counts[family] = counts.get(family, 0) + 1
    return counts


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_three_versions_on_three_nodes_evicted_and_stopped_leave_the_prefix_empty(tmp_path: Path):
    """Three versions of one file, each loaded through three daemons: each version's plan and digests are held by a
    lease (not the bare keys of before, which stayed for ever); evicting everything deletes them and every offer
    and claim, stopping the daemons takes the rest: the prefix is empty."""
    shape = LlamaShape(512, 1536, 2, 4000)
    (tmp_path / "origin").mkdir()
    path = tmp_path / "origin" / "model.safetensors"
    with fleet_of(tmp_path, "/life") as fleet:
        gateway = EtcdGateway([fleet.etcd])
        with fleet.daemon("a") as a, fleet.daemon("b") as b, fleet.daemon("c") as c:
            for version in range(3):
                state = llama_state_dict(shape, seed=60 + version)
                save_file(state, str(tmp_path / "next.safetensors"))
                replace_file(path, (tmp_path / "next.safetensors").read_bytes())
                for daemon in (a, b, c):
                    assert_same(weightstream.load_weights(fleet.file, cache=str(daemon.socket)), state)
                del state
                gc.collect()
            plans = {key: held for key, held in gateway.get_range("/life/plan/").items()}
            assert len(plans) == 3 and all(held.lease for held in plans.values()), plans
            assert all(held.lease for held in gateway.get_range("/life/digests/").values())
            for daemon in (a, b, c):
                answer = request(daemon.socket, {"op": "evict", "all": True})
                assert len(answer["evicted"]) == 3 and answer["kept_referenced"] == [], answer
            left = families(gateway, "/life")
            assert set(left) <= {"nodes", "served"}, f"evicted entries left keys behind: {left}"
        assert gateway.get_prefix("/life/") == {}, families(gateway, "/life")


def test_an_entrys_records_outlive_their_creator_and_end_with_the_last_holder(etcd: str, tmp_path: Path):
    """The node that planned an entry leaves while another holds it: the plan and digests stay (kept alive by the
    holder past several TTLs). The holder is killed: they end with their lease, within the TTL."""
    data = os.urandom(3 * PIECE)
    (tmp_path / "origin").mkdir()
    (tmp_path / "origin" / "model.safetensors").write_bytes(data)
    gateway = EtcdGateway([etcd])
    with RangeServer(tmp_path / "origin") as server:
        url = f"{server.url}/model.safetensors"
        first = Node(etcd, "/outlive", "first", url, tmp_path / "first", "--entry-ttl", "2")
        assert first.stats()["bytes_from_origin"] == len(data)
        second = Node(etcd, "/outlive", "second", url, tmp_path / "second", "--entry-ttl", "2")
        assert second.stats()["bytes_from_peers"] == len(data)
        records = {key: held.value for key, held in gateway.get_range("/outlive/").items()
                   if key.startswith(("/outlive/plan/", "/outlive/digests/"))}  # fmt: skip
        assert len(records) == 4, records
        first.leave()
        time.sleep(3 * 2)
        still = {key: gateway.get(key) for key in records}
        assert still == records, "the entry's records ended while a node held it"
        second.process.kill()
        second.process.communicate(timeout=30)
        wait_for(lambda: not any(gateway.get(key) for key in records), 10, "the dead holder's records stayed")
    gateway.delete_prefix("/outlive/")


def test_a_holder_publishes_its_entrys_records_again_when_they_ended(etcd: str, tmp_path: Path):
    """The entry's lease is revoked under a live holder (as when it was out of etcd's reach past the TTL): at its
    next renewal the holder publishes the plan and every digest again, the same values, under a new lease."""
    data = os.urandom(3 * PIECE)
    (tmp_path / "origin").mkdir()
    (tmp_path / "origin" / "model.safetensors").write_bytes(data)
    gateway = EtcdGateway([etcd])
    with RangeServer(tmp_path / "origin") as server:
        holder = Node(etcd, "/again", "holder", f"{server.url}/model.safetensors", tmp_path / "holder")
        try:
            assert holder.stats()["bytes_from_origin"] == len(data)
            before = {key: held for key, held in gateway.get_range("/again/").items()
                      if key.startswith(("/again/plan/", "/again/digests/"))}  # fmt: skip
            assert len(before) == 4, before
            lease = next(iter(before.values())).lease
            gateway.revoke(lease)
            assert not any(gateway.get(key) for key in before)
            wait_for(lambda: all(gateway.get(key) for key in before), 15, "the records were not published again")
            after = {key: gateway.get_held(key) for key in before}
            values = {key: value for key, (value, _) in after.items()}
            assert values == {key: held.value for key, held in before.items()}
            assert {held_lease for _, held_lease in after.values()} != {lease}, "published under the revoked lease"
        finally:
            holder.leave()
    gateway.delete_prefix("/again/")
