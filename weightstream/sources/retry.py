"""How object-store ranges are retried: which failures are transient, how long to wait, when to stop."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import TypeVar

from weightstream.errors import SourceError, SourceTimeout

Result = TypeVar("Result")

MAX_BACKOFF_S = 5.0
FIRST_BACKOFF_S = 0.1


class Transient(Exception):
    """A failure worth another attempt (5xx, SlowDown, a reset, a stall, a short body)."""

    def __init__(self, reason: str, *, stalled: bool = False) -> None:
        super().__init__(reason)
        self.stalled = stalled


@dataclasses.dataclass
class RetryPolicy:
    """Attempts, per-request stall timeout and the load's deadline (a monotonic time, or None)."""

    retries: int = 5
    request_timeout_s: float = 30.0
    deadline: float | None = None

    def wait_before(self, attempt: int, span: str, failure: Transient) -> None:
        """Sleep before attempt ``attempt`` (2, 3, ...), or raise if no attempt is left.

        Example:
            >>> RetryPolicy(retries=0).wait_before(2, "s3://b/k: range 0..8", Transient("503 SlowDown"))
            Traceback (most recent call last):
            ...
            weightstream.errors.SourceError: s3://b/k: range 0..8: gave up after 1 attempt(s): 503 SlowDown
        """
        if attempt > self.retries + 1:
            error = SourceTimeout if failure.stalled else SourceError
            raise error(f"{span}: gave up after {attempt - 1} attempt(s): {failure}")
        pause = random.uniform(0, min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (attempt - 2)))
        if self.deadline is not None and time.monotonic() + pause >= self.deadline:
            raise SourceTimeout(
                f"{span}: the load's deadline passed after {attempt - 1} attempt(s); last failure: {failure}"
            )
        time.sleep(pause)

    def run(self, span: str, attempt: Callable[[], Result]) -> Result:
        """``attempt()`` until it returns, trying again after each :class:`Transient` it raises, as
        :meth:`wait_before` allows; the deadline is checked before every attempt.

        Example:
            >>> tries = iter([Transient("503 SlowDown"), 42])
            >>> def flaky():
            ...     outcome = next(tries)
            ...     if isinstance(outcome, Exception):
            ...         raise outcome
            ...     return outcome
            >>> RetryPolicy().run("s3://b/k", flaky)
            42
        """
        number = 1
        while True:
            self.check_deadline(span)
            try:
                return attempt()
            except Transient as failure:
                number += 1
                self.wait_before(number, span, failure)

    def timeout(self) -> float:
        """Seconds the next wait for bytes may take: the stall timeout, or less if the deadline is nearer."""
        if self.deadline is None:
            return self.request_timeout_s
        return max(0.001, min(self.request_timeout_s, self.deadline - time.monotonic()))

    def check_deadline(self, span: str) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise SourceTimeout(f"{span}: the load's deadline passed")
