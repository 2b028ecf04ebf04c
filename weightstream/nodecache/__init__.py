"""The node weight cache, one package in two floors.

The client floor (imports only the source contract): ``protocol`` (the wire format), ``connection`` (the
daemon's socket and one connection's requests), ``client`` (a ``Store`` around the checkpoint's own store, as
fsspec's cached filesystems wrap another), and the GPU
import of segments and device copies (``gpu_import``, ``vmm``, ``shared_mapping``). The daemon floor,
``nodecache.daemon``: the server, its segments, the device tier and the ``weightstream cache`` commands.
"""
