"""HTTP(S): the range transport every remote store reads through, and the store of plain URLs."""
