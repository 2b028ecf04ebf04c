"""What the origin says of a whole file, checked against the bytes a fleet filled: an OCI blob's digest, an S3
object's SHA-256 checksum. Pieces from peers are checked against digests a member of the fleet published; this check
is against the origin's own, so a member that changes a piece and publishes its digest is caught here.

Example:
    >>> check_held(source, fd)  # doctest: +SKIP
    Traceback (most recent call last):
    ...
    weightstream.errors.IntegrityError: s3://b/model.safetensors: the bytes held for it hash to sha256:9f2c...
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os

from weightstream.errors import IntegrityError
from weightstream.sources.base import CheckedWhole, KnownDigest, Source


def says_whole(source: Source) -> bool:
    """Whether the origin of ``source`` states anything of the whole file to check it against."""
    return isinstance(source, CheckedWhole) or (isinstance(source, KnownDigest) and bool(source.whole_sha256))


def check_held(source: Source, fd: int) -> None:
    """Check the file ``fd`` (``source``'s bytes as this node holds them) against what the origin says of the whole
    (nothing where it says nothing; an OCI tar layer's other files are read from the registry).

    Raises:
        IntegrityError: the bytes are not the origin's.
    """
    if not says_whole(source):
        return
    size = os.fstat(fd).st_size
    with contextlib.closing(mmap.mmap(fd, size, prot=mmap.PROT_READ)) as mapping:
        held = memoryview(mapping)
        try:
            if isinstance(source, CheckedWhole):
                source.verify_whole(held)
            elif (actual := hashlib.sha256(held).hexdigest()) != source.whole_sha256:  # type: ignore[attr-defined]
                raise IntegrityError(
                    f"{source.uri}: the bytes held for it hash to sha256:{actual}, not the origin's checksum "
                    f"sha256:{source.whole_sha256}"  # type: ignore[attr-defined]
                )
        finally:
            held.release()
