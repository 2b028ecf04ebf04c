"""A fleet filling an OCI artifact: the registry's own blob digest checks what the fleet assembled. Daemons loading at
once read the weights' blob from the registry about once (the check hashes the bytes a node holds, peers' pieces
with its own, instead of reading the rest of the blob again); a peer that serves wrong bytes under a digest it
published itself (a member of the fleet lying) is caught by the blob digest, and the file is read from the registry
again."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="the fleet's data plane needs NIXL (pip install 'weightstream[fleet]')")

import weightstream
from tests.cache_daemon import Daemon, remove, request, stats
from tests.cache_daemon import places as cache_places
from tests.conftest import assert_same, save_hf_sharded
from tests.etcd_server import etcd_server
from tests.faultproxy import FaultProxy
from tests.objstore import oci_registry
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway
from weightstream.save.push import push

pytestmark = pytest.mark.slow

SHAPE = LlamaShape(hidden=512, intermediate=1408, layers=2, vocab=2000)


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Iterator[FaultProxy]:
    """A registry behind a proxy that records every request (what the fleet read from it)."""
    with oci_registry(tmp_path_factory.mktemp("registry")) as address, FaultProxy(int(address.split(":")[1])) as proxy:
        yield proxy


def pushed(registry: FaultProxy, tmp_path: Path, name: str, seed: int) -> tuple[str, dict, str, int]:
    """An artifact of one shard, pushed: its URI through the proxy, its tensors, the weights' blob digest and size."""
    state = llama_state_dict(SHAPE, seed=seed)
    local = Path(save_hf_sharded(state, tmp_path / "checkpoint", shards=1))
    push(str(local), f"oci://127.0.0.1:{registry.upstream_port}/fleet/{name}:v1")
    weights = (local / "model-00001-of-00001.safetensors").read_bytes()
    return (
        f"oci://127.0.0.1:{registry.port}/fleet/{name}:v1",
        state,
        f"sha256:{hashlib.sha256(weights).hexdigest()}",
        len(weights),
    )


def blob_bytes(registry: FaultProxy, digest: str) -> int:
    """Bytes of blob ``digest`` asked of the registry so far (its range GETs)."""
    total = 0
    for line, ranges in list(registry.requests):
        if line.startswith("GET") and f"/blobs/{digest}" in line:
            span = re.fullmatch(r"bytes=(\d+)-(\d+)", ranges or "")
            assert span is not None, f"a whole-blob GET: {line}"
            total += int(span[2]) - int(span[1]) + 1
    return total


@contextlib.contextmanager
def fleet_daemons(tmp_path: Path, prefix: str, count: int) -> Iterator[tuple[str, list[Daemon]]]:
    """etcd and ``count`` daemons of the fleet at ``prefix``: (etcd's URL, the daemons)."""
    places = [cache_places(f"ocifleet{n}") for n in range(count)]
    try:
        with etcd_server(tmp_path) as etcd, contextlib.ExitStack() as stack:
            fleet = etcd.replace("http://", "etcd://") + prefix
            daemons = [
                stack.enter_context(Daemon(*place, "--fleet", fleet, "--fleet-node", f"node{n}"))
                for n, place in enumerate(places)
            ]
            yield etcd, daemons
    finally:
        for place in places:
            remove(*place)


def test_daemons_loading_at_once_read_the_weights_blob_about_once(registry, tmp_path: Path):
    uri, state, digest, size = pushed(registry, tmp_path, "storm", seed=31)
    with fleet_daemons(tmp_path, "/oci-storm", 3) as (_, daemons):
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            loads = [pool.submit(weightstream.load_weights, uri, cache=str(daemon.socket)) for daemon in daemons]
            for load in loads:
                assert_same(load.result(), state)
        read = blob_bytes(registry, digest)
        assert read <= 1.1 * size, f"the registry served {read / size:.2f}x the weights' blob to three daemons"
        (entry,) = [item["key"] for item in request(daemons[0].socket, {"op": "ls"})["entries"] if item["size"] == size]
        fleets = [stats(daemon.socket)["fleet"] for daemon in daemons]
        assert sum(f["entries"][entry]["bytes_from_peers"] for f in fleets) == 2 * size, fleets
        assert sum(f["entries"][entry]["bytes_from_origin"] for f in fleets) == size, fleets
        assert all(f["entries_refetched"] == 0 for f in fleets), fleets


def test_a_peer_lying_about_a_piece_is_caught_by_the_blob_digest(registry, tmp_path: Path):
    """A member of the fleet serves a changed piece under a digest it wrote itself: the piece passes its own check,
    the blob's digest fails, and the late node reads the file from the registry instead (counted, logged), then
    offers the registry's bytes and corrects the lying digest: a node joining after the liar left reads them all from
    it."""
    uri, state, digest, size = pushed(registry, tmp_path, "lying", seed=32)
    with fleet_daemons(tmp_path, "/oci-lying", 3) as (etcd, (liar, honest, joiner)):
        assert_same(weightstream.load_weights(uri, cache=str(liar.socket)), state)
        (entry,) = [item for item in request(liar.socket, {"op": "ls"})["entries"] if item["size"] == size]
        segment = liar.directory / f"{entry['key']}.seg"
        segment.chmod(0o644)  # root, as a member of the fleet that changes what it serves
        gateway = EtcdGateway([etcd])
        piece_bytes = int(gateway.get(f"/oci-lying/plan/{entry['key']}"))
        with open(segment, "r+b") as held:
            held.seek(size // 2)
            held.write(b"\x5a" * 16)
            piece = size // 2 // piece_bytes
            held.seek(piece * piece_bytes)
            lie = hashlib.sha256(held.read(piece_bytes)).hexdigest()
        gateway.put(f"/oci-lying/digests/{entry['key']}/{piece}", lie.encode())
        before = blob_bytes(registry, digest)

        assert_same(weightstream.load_weights(uri, cache=str(honest.socket)), state)
        counts = stats(honest.socket)["fleet"]
        weights = counts["entries"][entry["key"]]
        assert (weights["entries_refetched"], weights["bytes_from_peers"], weights["bytes_refetched"]) == (
            1,
            size,
            size,
        ), weights
        assert counts["entries_refetched"] == 1, counts
        again = blob_bytes(registry, digest) - before
        assert size <= again < 1.01 * size, f"{again} bytes read from the registry again, not the file's {size}"
        assert f"{digest}: the bytes held for it hash to sha256:" in honest.log(), honest.log()[-2000:]
        assert "some came from peers" in honest.log()
        assert gateway.get(f"/oci-lying/complete/{entry['key']}/node1") is not None, "not offered again"
        assert gateway.get(f"/oci-lying/digests/{entry['key']}/{piece}") != lie.encode(), "the lie still stands"
        assert f"piece {piece}'s digest corrected" in honest.log()
        liar.stop()  # its offers go with its lease
        after = blob_bytes(registry, digest)
        assert_same(weightstream.load_weights(uri, cache=str(joiner.socket)), state)
        joined = stats(joiner.socket)["fleet"]["entries"][entry["key"]]
        assert (joined["bytes_from_peers"], joined["entries_refetched"]) == (size, 0), joined
        assert blob_bytes(registry, digest) - after < 0.01 * size, "the joiner read the weights from the registry"
