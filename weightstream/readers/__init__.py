"""How bytes move: the parallel reader and its landings (direct, staged, GDS, streaming, layered, distributed)."""
