"""Benchmarks: demo checkpoints, peer loaders, machine limits, interleaved rounds."""
