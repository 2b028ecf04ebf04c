"""How bytes are read: one module per registry entry."""
