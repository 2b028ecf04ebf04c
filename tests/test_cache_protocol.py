"""The cache's wire format on its own: framing, bounds, descriptors, and requests checked field by field."""

from __future__ import annotations

import os
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightstream.errors import CacheProtocolError, CacheUnavailableError
from weightstream.nodecache.daemon.segments import SIGNING_PARAMETERS, unsigned
from weightstream.nodecache.protocol import LENGTH, OPERATIONS, check_request, encode, receive, send

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["op", "uri", "size", "version", "storage_options", "key", "x"]), JSON))
def test_a_request_is_an_operation_or_a_protocol_error(message):
    try:
        assert check_request(message) in OPERATIONS
    except CacheProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_are_a_message_or_a_typed_error(data):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(data)
        theirs.shutdown(socket.SHUT_WR)
        try:
            message, fds = receive(ours, 1 << 10, "test")
        except (CacheProtocolError, CacheUnavailableError):
            return
        assert isinstance(message, dict) and fds == []


def test_a_message_and_its_descriptor_arrive_together(tmp_path, no_leaks):
    (tmp_path / "f").write_bytes(b"segment")
    ours, theirs = socket.socketpair()
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    with ours, theirs:
        send(theirs, {"ok": True, "key": "k"}, (fd,))
        os.close(fd)
        message, fds = receive(ours, 1 << 10, "test")
        assert message == {"ok": True, "key": "k"} and len(fds) == 1
        assert os.pread(fds[0], 7, 0) == b"segment"
        os.close(fds[0])


def test_more_descriptors_than_a_message_may_carry_are_closed_and_refused(tmp_path, no_leaks):
    (tmp_path / "f").write_bytes(b"x")
    ours, theirs = socket.socketpair()
    fds = [os.open(tmp_path / "f", os.O_RDONLY) for _ in range(3)]
    with ours, theirs:
        socket.send_fds(theirs, [encode({"ok": True})], fds)
        for fd in fds:
            os.close(fd)
        with pytest.raises(CacheProtocolError, match=r"more descriptors than the 1 a message may carry"):
            receive(ours, 1 << 10, "test")


def test_a_length_over_the_limit_is_refused_before_reading_the_body(no_leaks):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(LENGTH.pack(1 << 30))
        with pytest.raises(CacheProtocolError, match=r"test: a message of 1073741824 bytes; at most 1024 are accepted"):
            receive(ours, 1 << 10, "test")


SIGNING = st.sampled_from(["sig", "se", "sv", "sp", "X-Amz-Signature", "X-Amz-Date", "x-goog-credential", "token"])
NAMING = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=8).filter(
    lambda name: name not in SIGNING_PARAMETERS and not name.startswith(("x-amz-", "x-goog-"))
)
VALUES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789%", max_size=12)


@given(st.lists(st.tuples(NAMING, VALUES), max_size=4), st.lists(st.tuples(SIGNING, VALUES), max_size=4))
def test_a_urls_key_keeps_what_names_the_object_and_drops_what_signs_it(naming, signing):
    import urllib.parse

    base = "https://host.example/bucket/model.safetensors"
    signed = base + "?" + urllib.parse.urlencode(naming + signing) if naming or signing else base
    re_signed = base + "?" + urllib.parse.urlencode(naming + [(name, value + "x") for name, value in signing])
    assert unsigned(signed) == unsigned(re_signed if naming or signing else base)
    kept = urllib.parse.parse_qsl(urllib.parse.urlsplit(unsigned(signed)).query, keep_blank_values=True)
    assert kept == naming
