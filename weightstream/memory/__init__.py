"""Where bytes land: host arenas (and, later, pinned and CUDA memory)."""
