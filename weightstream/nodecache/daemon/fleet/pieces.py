"""A fleet's cut of a file: the piece size a node proposes, the pieces' spans, how long a fill waits for peers, and
what a fill counts of where its bytes came from (:class:`FillStats`, shown by ``stats`` as ``fleet``).

Example:
    >>> piece_spans(20 << 20, piece_size(20 << 20))
    [(0, 8388608), (8388608, 8388608), (16777216, 4194304)]
"""

from __future__ import annotations

import dataclasses

PIECE_BYTES = 64 << 20
"""The largest piece: its three etcd writes (claim, digest, done) cost nothing beside moving it, and a 140 GB model is
about 2,000 pieces, which every filling node's poll of the claims reads in one range request."""
MIN_PIECE_BYTES = 8 << 20
PIECES_PER_FILE = 16
"""Files under 1 GiB are cut into about this many pieces (at least ``MIN_PIECE_BYTES`` each): peers fetch the first
pieces while the origin still serves the last, where 64 MiB pieces of a 256 MiB file all finished together."""
FILL_DEADLINE_S = 60.0
SLOWEST_PEER_BYTES_PER_S = 100e6
"""A fill's peers have ``FILL_DEADLINE_S`` plus its size at this rate to deliver; past that, what is still missing is
read from the origin (``pieces_past_deadline``): fleet fill may save origin reads, never make a load wait without
end for peers that are alive but slow."""


@dataclasses.dataclass
class FillStats:
    """Where one fill's bytes came from."""

    bytes_from_origin: int = 0
    bytes_from_peers: int = 0
    pieces_verified: int = 0
    """Pieces read from peers that matched their digest."""
    pieces_refetched: int = 0
    """Pieces a peer served that failed their check (or that a peer failed to serve, or whose claimer stalled), read
    from the origin again."""
    bytes_refetched: int = 0
    peer_failures: int = 0
    entries_refetched: int = 0
    """Fills whose pieces all passed their checks and the whole then failed the origin's own digest (an OCI blob's):
    read whole from the origin again."""
    bytes_from_peer_devices: int = 0
    """Of ``bytes_from_peers``, those read from a peer's device copy into this node's (GPU to GPU)."""
    digests_corrected: int = 0
    """Published piece digests that the origin's own bytes (read again after a peer's failed them) did not match:
    published again as the origin's."""
    claims_taken_over: int = 0
    """Pieces whose claimer had not finished them in ``stall_s``: claimed by this node, read from the origin and
    their digest published."""
    pieces_past_deadline: int = 0
    """Pieces still missing at the fill's deadline (see :data:`FILL_DEADLINE_S`), read from the origin (counted in
    ``bytes_from_origin`` too)."""


def piece_size(size: int) -> int:
    """The piece size a node proposes for a file of ``size`` bytes (a multiple of 1 MiB).

    Example:
        >>> [piece_size(n) >> 20 for n in (10 << 20, 256 << 20, 4 << 30)]
        [8, 16, 64]
    """
    wanted = -(-size // PIECES_PER_FILE)
    return min(PIECE_BYTES, max(MIN_PIECE_BYTES, -(-wanted >> 20) << 20))


def fill_deadline(size: int) -> float:
    """Seconds a fill of ``size`` bytes waits for peers before it reads the rest from the origin.

    Example:
        >>> fill_deadline(0), fill_deadline(10**10)
        (60.0, 160.0)
    """
    return FILL_DEADLINE_S + size / SLOWEST_PEER_BYTES_PER_S


def piece_spans(size: int, piece_bytes: int) -> list[tuple[int, int]]:
    """Each piece of a ``size``-byte file cut into ``piece_bytes``, in order: its offset and length.

    Example:
        >>> piece_spans(20 << 20, 8 << 20)
        [(0, 8388608), (8388608, 8388608), (16777216, 4194304)]
    """
    return [(offset, min(piece_bytes, size - offset)) for offset in range(0, size, piece_bytes)]
