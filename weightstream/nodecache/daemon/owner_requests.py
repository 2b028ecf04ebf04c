"""What only the daemon's own user may ask: ``ls`` (every entry, oldest use first, with the processes that hold it)
and ``evict`` (entries by key, by the URI of a file or a directory holding them, or all; those still referenced are
kept). ``stop`` is the server's own."""

from __future__ import annotations

from collections.abc import Mapping

from weightstream.errors import CacheError, CacheProtocolError
from weightstream.nodecache.daemon.entries import EntryTable
from weightstream.nodecache.daemon.segments import Segment, SegmentStore


def listing(segments: SegmentStore) -> dict[str, object]:
    """The answer to ``ls``."""
    references = segments.references()
    ordered = sorted(segments.segments.values(), key=lambda segment: segment.last_used)
    entries = [{**segment.describe(), "references": sorted(references.get(segment.key, ()))} for segment in ordered]
    return {"ok": True, "entries": entries}


def evict(request: Mapping[str, object], segments: SegmentStore, entries: EntryTable) -> dict[str, object]:
    """The answer to ``evict``: what was evicted and what was kept because a process still maps it.

    Raises:
        CacheError: no entry of the URI named. CacheProtocolError: nothing named.
    """
    key, uri = request.get("key"), request.get("uri")
    if key is not None:
        keys: list[str] | None = [str(key)]
    elif uri is not None:
        keys = [segment.key for segment in list(segments.segments.values()) if _names(segment, str(uri))]
        if not keys:
            raise CacheError(f"no cache entry of {str(uri)[:200]}")
    elif request.get("all") is True:
        keys = None
    else:
        raise CacheProtocolError("evict: name a key or a uri, or say all")
    evicted, kept = entries.evict(keys)
    return {"ok": True, "evicted": evicted, "kept_referenced": kept}


def _names(segment: Segment, uri: str) -> bool:
    """Whether ``uri`` names ``segment``: its file, or a directory (prefix) holding it."""
    return segment.uri == uri or segment.uri.startswith(uri.rstrip("/") + "/")
