"""An object store whose endpoint has no such host fails at once with that said, before any SDK retries it as a
broken connection (gcsfs did for minutes, then "stalled"). ``.invalid`` names never resolve (RFC 6761)."""

from __future__ import annotations

import socket

import pytest

import weightstream
from weightstream.errors import SourceError
from weightstream.sources.objects import hosts


@pytest.mark.parametrize(
    ("uri", "storage_options", "endpoint"),
    [
        (
            "s3://bucket/model",
            {"endpoint_url": "http://s3.example.invalid:8333", "key": "k", "secret": "s"},
            "http://s3.example.invalid:8333",
        ),
        (
            "gs://bucket/model",
            {"endpoint_url": "http://gcs.example.invalid:4443", "token": "anon"},
            "http://gcs.example.invalid:4443",
        ),
        (
            "az://container/model",
            {"account_name": "acct", "account_host": "acct.blob.example.invalid", "anon": True},
            "https://acct.blob.example.invalid",
        ),
    ],
)
def test_an_endpoint_with_no_such_host_fails_at_once(uri, storage_options, endpoint, no_leaks):
    host = endpoint.split("://")[1].split(":")[0]
    with pytest.raises(SourceError, match=rf"^{uri[:2]}:// on {endpoint}: {host}: no such host \("):
        weightstream.open(uri, storage_options=storage_options)


def test_gs_checks_the_emulator_it_is_pointed_at(monkeypatch, no_leaks):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "gcs-emulator.example.invalid:4443")
    with pytest.raises(SourceError, match=r"^gs:// on http://gcs-emulator.example.invalid:4443: .*no such host"):
        weightstream.open("gs://bucket/model", storage_options={"token": "anon"})


def test_a_resolver_that_cannot_answer_is_asked_again_then_refused(monkeypatch):
    """``EAI_AGAIN`` (no resolver reachable) is asked again a few times, then said as what it likely is."""
    calls = []

    def unreachable(*args, **kwargs):
        calls.append(args[0])
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(hosts.socket, "getaddrinfo", unreachable)
    monkeypatch.setattr(hosts, "LOOKUP_RETRY_S", (0.0, 0.0))
    with pytest.raises(SourceError) as refused:
        hosts.check_endpoint("s3", "https://s3.amazonaws.com")
    assert str(refused.value) == (
        "s3:// on https://s3.amazonaws.com: the name s3.amazonaws.com did not resolve in 0 s (Temporary failure in "
        "name resolution): is there a network?"
    )
    assert calls == ["s3.amazonaws.com"] * 3
