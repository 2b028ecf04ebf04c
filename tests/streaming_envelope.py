"""Run in a fresh process: stream a checkpoint with a consumer that drops each tensor, and print
the peak RSS above the baseline as JSON. ``python -m tests.streaming_envelope URI WINDOW``."""

from __future__ import annotations

import json
import sys

import weightstream


def rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def peak_rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def start_peak() -> int:
    """The RSS now, from which the peak (VmHWM) is measured from here on."""
    baseline = rss()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS
    return baseline


def main(uri: str, window: int) -> dict:
    stream = weightstream.iter_weights(uri, max_inflight_bytes=window)  # headers read, store opened
    baseline = start_peak()
    count = total = 0
    for _, tensor in stream:
        count, total = count + 1, total + tensor.numel() * tensor.element_size()
        del tensor
    return {"baseline": baseline, "peak_above_baseline": peak_rss() - baseline, "tensors": count, "bytes": total}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
