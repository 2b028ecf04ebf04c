"""What bytes mean: checkpoint formats, parsed and validated without I/O of their own."""
