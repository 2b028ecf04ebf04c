"""Run in a fresh process: read a checkpoint layer by layer with a consumer that drops each layer
before asking for the next, and print as JSON the peak RSS above the baseline and the largest layer's bytes.
``python -m tests.layered_envelope URI PREFETCH_LAYERS``."""

from __future__ import annotations

import json
import sys

import weightstream
from tests.streaming_envelope import peak_rss, start_peak
from weightstream.planning.layers import group_layers


def main(uri: str, prefetch_layers: int) -> dict:
    with weightstream.open(uri, "layered", prefetch_layers=prefetch_layers) as checkpoint:
        largest = max(
            layer.nbytes for layer in group_layers(checkpoint.plan.tensors, checkpoint.options.loader_options.rule)
        )
    layers = weightstream.iter_layers(uri, prefetch_layers=prefetch_layers)  # headers read, store opened
    baseline = start_peak()
    count = total = 0
    for _, tensors in layers:
        for tensor in tensors.values():
            total += tensor.numel() * tensor.element_size()
        count += 1
        del tensors
    return {
        "baseline": baseline,
        "peak_above_baseline": peak_rss() - baseline,
        "largest_layer": largest,
        "layers": count,
        "bytes": total,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
