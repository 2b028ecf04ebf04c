"""The node weight cache daemon: segments in shared memory, served over a Unix socket (see ``daemon``)."""
