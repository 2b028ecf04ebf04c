"""A copy engine for stress tests: the real CPU engine, with random delays and a tripwire."""

from __future__ import annotations

import random
import threading
import time

import torch

from weightstream.memory.ring import CpuCopyEngine


class DelayedCheckingEngine(CpuCopyEngine):
    """The real CPU engine, with random delays before each copy, checking that nobody wrote into
    a slot between the launch of its copy and the copy itself (a slot reused too early)."""

    def __init__(self, seed: int, fail_at: int | None = None) -> None:
        super().__init__(threads=2)
        self.random = random.Random(seed)
        self.fail_at = fail_at
        self.launched = 0
        self.violations: list[str] = []
        self.count_lock = threading.Lock()

    def launch(self, source, destination):
        with self.count_lock:
            self.launched += 1
            number = self.launched
            delay = self.random.random() * 0.004
        return super().launch((source, source.clone(), number, delay), destination)

    def _copy(self, staged, destination):
        source, snapshot, number, delay = staged
        time.sleep(delay)
        if number == self.fail_at:
            raise OSError(5, f"copy {number} failed")
        if not torch.equal(source, snapshot):
            self.violations.append(f"copy {number}: its slot was overwritten before the copy ran")
        destination.copy_(source)
