"""RetryPolicy, the small piece: attempts, backoff bounds, deadlines, and which error ends it."""

from __future__ import annotations

import time

import pytest

from weightstream.errors import SourceError, SourceTimeout
from weightstream.sources.retry import MAX_BACKOFF_S, RetryPolicy, Transient


def test_waits_grow_and_stay_bounded(monkeypatch):
    pauses = []
    monkeypatch.setattr(time, "sleep", pauses.append)
    policy = RetryPolicy(retries=12)
    for attempt in range(2, 14):
        policy.wait_before(attempt, "span", Transient("503"))
    assert len(pauses) == 12 and all(0 <= pause <= MAX_BACKOFF_S for pause in pauses)


def test_stalls_end_in_a_timeout_other_failures_in_a_source_error():
    with pytest.raises(SourceTimeout, match=r"span: gave up after 2 attempt\(s\): stalled"):
        RetryPolicy(retries=1).wait_before(3, "span", Transient("stalled", stalled=True))
    with pytest.raises(SourceError, match=r"span: gave up after 2 attempt\(s\): reset") as raised:
        RetryPolicy(retries=1).wait_before(3, "span", Transient("reset"))
    assert not isinstance(raised.value, SourceTimeout)


def test_the_deadline_bounds_waits_and_timeouts():
    policy = RetryPolicy(retries=5, request_timeout_s=30, deadline=time.monotonic() + 0.5)
    assert policy.timeout() <= 0.5
    with pytest.raises(SourceTimeout, match="span: the load's deadline passed"):
        RetryPolicy(deadline=time.monotonic() - 1).check_deadline("span")
