"""Device copies filled from a peer's device copy, between real processes (etcd, NIXL agents over UCX), with host
memory standing for the GPUs (``tests.fleet_node.HostCopies``; the GPU machine's check runs the same path on VRAM):
each piece lands in the new copy, is copied to the host segment and checked against its claimer's digest; a copy is
kept only when every piece matched; a peer whose copy is bad, a peer that died, or an entry whose digests are not all
published sends the fill the host way, counted, and the node still ends with the origin's bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu12", reason="the fleet's data plane needs NIXL (pip install 'weightstream[fleet]')")

from tests import test_fleet_fill
from tests.fleet_node import GPU
from tests.test_fleet_fill import Node
from weightstream.nodecache.daemon.fleet.etcd import EtcdGateway
from weightstream.nodecache.daemon.fleet.node import describe_fleet, parse_fleet

etcd, origin = test_fleet_fill.etcd, test_fleet_fill.origin
"""test_fleet_fill's fixtures: one etcd for the module, an HTTP origin of 48 MiB (six pieces) per test."""


def test_a_device_copy_is_read_from_a_peers_copy_and_checked_piece_by_piece(etcd: str, origin, tmp_path: Path):
    server, url, data = origin
    holder = Node(etcd, "/devices", "holder", url, tmp_path / "holder", "--offer-device")
    try:
        assert holder.stats()["device_copies"] == [hashlib.sha256(data).hexdigest()]
        before = server.ranged_bytes()
        reader = Node(etcd, "/devices", "reader", url, tmp_path / "reader", "--device-fill")
        filled = reader.stats()
        assert reader.output.read_bytes() == data, "the host segment is not the origin's bytes"
        assert filled["device_copies"] == [hashlib.sha256(data).hexdigest()], "the device copy is not the origin's"
        assert filled["bytes_from_peer_devices"] == filled["bytes_from_peers"] == len(data), filled
        assert (filled["bytes_from_origin"], filled["pieces_verified"], filled["peer_failures"]) == (0, 6, 0)
        assert server.ranged_bytes() == before, "the device fill read from the origin"
        fleet = describe_fleet(parse_fleet([etcd.replace("http://", "etcd://") + "/devices"]))
        (entry,) = fleet["nodes"]["holder"]["complete"]
        assert fleet["nodes"]["holder"]["devices"] == [f"{entry} {GPU}"], fleet
        assert fleet["nodes"]["reader"]["complete"] == [entry], "the reader's segment was not offered"
        reader.leave()
    except BaseException:
        holder.leave()
        raise
    assert holder.leave() == {entry: len(data)}, "the holder did not count the bytes its peer read"


def test_a_peer_whose_device_copy_is_bad_is_caught_and_the_fill_goes_the_host_way(etcd: str, origin, tmp_path: Path):
    _, url, data = origin
    holder = Node(etcd, "/bad-copy", "holder", url, tmp_path / "holder", "--offer-device", "--corrupt-device")
    try:
        holder.stats()
        reader = Node(etcd, "/bad-copy", "reader", url, tmp_path / "reader", "--device-fill")
        filled = reader.stats()
        assert reader.output.read_bytes() == data, "a bad piece was kept"
        assert filled["device_copies"] == [], "a device copy with a bad piece was kept"
        assert (filled["peer_failures"], filled["bytes_from_peer_devices"]) == (1, 0), filled
        assert filled["bytes_from_peers"] == len(data), "the host way did not read the holder's good segment"
        reader.leave()
    finally:
        holder.leave()


def test_a_dead_peers_device_copy_is_not_waited_on(etcd: str, origin, tmp_path: Path):
    _, url, data = origin
    holder = Node(etcd, "/dead-copy", "holder", url, tmp_path / "holder", "--offer-device")
    holder.stats()
    holder.process.kill()  # its offers stay in etcd until its lease (5 s) expires
    holder.process.communicate(timeout=30)
    assert EtcdGateway([etcd]).get_prefix("/dead-copy/devices/"), "the dead holder's offer is already gone"
    reader = Node(etcd, "/dead-copy", "reader", url, tmp_path / "reader", "--device-fill")
    filled = reader.stats()
    assert reader.output.read_bytes() == data
    assert filled["device_copies"] == [] and filled["bytes_from_peer_devices"] == 0, filled
    assert filled["peer_failures"] >= 1, filled
    assert filled["bytes_from_origin"] + filled["bytes_refetched"] == len(data), filled
    reader.leave()


def test_without_a_digest_for_every_piece_no_device_copy_is_read(etcd: str, origin, tmp_path: Path):
    _, url, data = origin
    holder = Node(etcd, "/no-digest", "holder", url, tmp_path / "holder", "--offer-device")
    try:
        holder.stats()
        gateway = EtcdGateway([etcd])
        (digest,) = [key for key in gateway.get_prefix("/no-digest/digests/") if key.endswith("/5")]
        gateway.delete(digest)
        reader = Node(etcd, "/no-digest", "reader", url, tmp_path / "reader", "--device-fill")
        filled = reader.stats()
        assert reader.output.read_bytes() == data
        assert filled["device_copies"] == [] and filled["bytes_from_peer_devices"] == 0, filled
        assert filled["peer_failures"] == 0, "the device copy was read, then found unchecked"
        assert filled["bytes_from_peers"] + filled["bytes_from_origin"] == len(data), filled
        reader.leave()
    finally:
        holder.leave()
