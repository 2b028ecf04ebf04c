"""What to read: a checkpoint's files and headers, tensor specs, layer groups and coalesced read requests."""
