"""Eviction in a fleet, as real processes: a daemon's own offers to its peers (its NIXL registrations, mappings of
its segments) are its bookkeeping, never references, so a node whose budget holds two checkpoints fills a third and
`cache evict --all` empties it; each eviction withdraws the offer (etcd, then NIXL) before the segment goes, and a
peer reading the entry at that moment fails the piece typed and reads it from the origin, bit-exact."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="the fleet's data plane needs NIXL (pip install 'weightstream[fleet]')")

from safetensors.torch import save_file

import weightstream
from tests import netns
from tests.cache_daemon import request, stats
from tests.conftest import assert_same
from tests.etcd_server import etcd_server
from tests.rangeserver import RangeServer
from tests.test_fleet_daemons import fleet_of
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway


def checkpoints(tmp_path: Path, count: int, hidden: int = 512) -> tuple[list[dict], int]:
    """``count`` two-layer checkpoints of one shape in ``tmp_path/origin/model-N.safetensors``: their tensors and the
    size of each file."""
    (tmp_path / "origin").mkdir()
    states = []
    for number in range(count):
        state = llama_state_dict(LlamaShape(hidden, round(hidden * 2.75 / 256) * 256, 2, 4000), seed=30 + number)
        save_file(state, str(tmp_path / "origin" / f"model-{number}.safetensors"))
        states.append(state)
    return states, (tmp_path / "origin" / "model-0.safetensors").stat().st_size


def mapped_segments(pid: int, directory: Path) -> list[str]:
    """The lines of ``pid``'s memory map that map a file of the cache ``directory`` (a deleted one included)."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return [line for line in lines if str(directory) in line]


def node_keys(etcd: str, prefix: str, node: str) -> list[str]:
    """The keys saying ``node`` holds or fills an entry (``segments/`` and ``complete/``)."""
    everything = EtcdGateway([etcd]).get_prefix(prefix + "/")
    return sorted(key for key in everything if key.startswith((f"{prefix}/segments/", f"{prefix}/complete/"))
                  and key.endswith(f"/{node}"))  # fmt: skip


def test_a_fleet_node_with_room_for_two_fills_a_third_and_evicts_everything(tmp_path: Path):
    states, size = checkpoints(tmp_path, 3)
    with fleet_of(tmp_path, "/evict") as fleet, fleet.daemon("small", "--budget", str(size * 5 // 2)) as small:
        base = fleet.file.rsplit("/", 1)[0]
        for number, state in enumerate(states):
            assert_same(weightstream.load_weights(f"{base}/model-{number}.safetensors", cache=str(small.socket)), state)
            gc.collect()  # the loaded tensors map the segment: gone, it is evictable
        listed = request(small.socket, {"op": "ls"})["entries"]
        assert [entry["uri"].rsplit("/", 1)[1] for entry in listed] == ["model-1.safetensors", "model-2.safetensors"]
        held = {entry["key"] for entry in listed}
        assert {key.split("/")[-2] for key in node_keys(fleet.etcd, "/evict", "small")} == held
        answer = request(small.socket, {"op": "evict", "all": True})
        assert sorted(answer["evicted"]) == sorted(held) and answer["kept_referenced"] == [], answer
        assert node_keys(fleet.etcd, "/evict", "small") == [], "evicted entries still offered in etcd"
        assert mapped_segments(small.process.pid, small.directory) == [], "the daemon still maps evicted segments"
        assert stats(small.socket)["entries"] == 0


@pytest.mark.skipif(netns.available() is not None, reason=f"separate machines: {netns.available()}")
def test_an_entry_evicted_while_a_peer_reads_it_is_read_elsewhere_by_that_peer(tmp_path: Path):
    """The reader's link is slow (its pieces take seconds): the holder evicts the entry mid-read, the reader's read of
    it fails typed (no longer offered, or bytes that are not the piece) and its pieces come from the origin."""
    from tests.test_fleet_network import daemon_on, load_on

    states, size = checkpoints(tmp_path, 1, hidden=1024)
    with contextlib.ExitStack() as stack:
        network = stack.enter_context(netns.Network())
        origin_machine = network.machine("origin")
        holder_machine, reader_machine = network.machine("holder"), network.machine("reader", mbit=80)
        etcd = stack.enter_context(etcd_server(tmp_path, network))
        with network.inside(origin_machine):
            origin = stack.enter_context(RangeServer(tmp_path / "origin", host=origin_machine.address))
        fleet = etcd.replace("http://", "etcd://") + "/evicting"
        holder = stack.enter_context(daemon_on(network, holder_machine, fleet))
        reader = stack.enter_context(daemon_on(network, reader_machine, fleet))
        url = f"{origin.url}/model-0.safetensors"
        assert_same(load_on(network, holder_machine, url, holder), states[0])
        gc.collect()
        loaded: dict[str, object] = {}
        reading = threading.Thread(target=lambda: loaded.update(load_on(network, reader_machine, url, reader)))
        reading.start()
        try:
            deadline = time.monotonic() + 30
            while network.received_bytes(reader_machine) < 4 << 20 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert stats(reader.socket)["filling"] == 1, "the reader finished before the eviction: the link is fast"
            answer = request(holder.socket, {"op": "evict", "all": True})
            assert len(answer["evicted"]) == 1, answer
        finally:
            reading.join(timeout=120)
        assert_same(loaded, states[0])  # type: ignore[arg-type]
        counts = stats(reader.socket)["fleet"]
        assert counts["peer_failures"] >= 1 and counts["bytes_from_origin"] + counts["bytes_refetched"] > 0, counts
        assert counts["bytes_from_peers"] + counts["bytes_from_origin"] + counts["bytes_refetched"] >= size, counts
        assert holder.process.poll() is None, "the holder died"
        assert mapped_segments(holder.process.pid, holder.directory) == []
        assert stats(holder.socket)["entries"] == 0
