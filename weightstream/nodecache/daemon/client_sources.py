"""The source an ``attach`` names, opened with the client's rights: a local file as the descriptor the client opened
(the daemon never opens a path for a client), a remote one with the client's own credentials unless the client is the
daemon's own user, and with a request to the store, which proves the client may read it before any entry is handed
over."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from weightstream.errors import CacheProtocolError, SourceChangedError
from weightstream.nodecache.daemon.credentials import check_own_credentials
from weightstream.nodecache.daemon.endpoint import Peer
from weightstream.nodecache.daemon.segments import LOCAL_FILE, segment_key, unsigned
from weightstream.nodecache.daemon.stores import StorePool
from weightstream.sources.base import Source
from weightstream.sources.local.file import LocalFile


@contextlib.contextmanager
def open_for_client(
    peer: Peer, request: Mapping[str, object], fds: list[int], stores: StorePool
) -> Iterator[tuple[Source, str]]:
    """The source a request names, opened with the client's rights, and its entry's key.

    A local file comes as the descriptor the client opened (the daemon never opens a path for a client); a
    remote source is opened with the client's own credentials unless the client is the daemon's own user, and
    then with a request to the store, which proves the client may read it before any entry is handed over.
    """
    uri = str(request["uri"])
    size, version = request.get("size"), request.get("version")
    with contextlib.ExitStack() as held:
        if "://" not in uri or uri.startswith("file://"):
            if len(fds) != 1:
                raise CacheProtocolError(
                    f"{uri}: a local file comes to the cache daemon as a descriptor the client opened; "
                    f"{len(fds)} came with the request"
                )
            source: Source = LocalFile.from_descriptor(fds.pop(), uri, direct="auto")
            held.callback(source.close)
            key = segment_key(LOCAL_FILE, source.size, source.version)
        else:
            if fds:
                raise CacheProtocolError(f"{uri}: only a local file comes with a descriptor")
            options: Mapping[str, object] = request.get("storage_options") or {}  # type: ignore[assignment]
            if not peer.owner:
                check_own_credentials(uri, options)
            store = held.enter_context(stores.borrow(uri, options))
            pinned = peer.owner and isinstance(size, int) and isinstance(version, str)
            source = store.open_pinned(uri, size, version) if pinned else store.open(uri)  # type: ignore[arg-type]
            held.callback(source.close)
            key = segment_key(unsigned(uri), source.size, source.version)
        _check_planned(uri, size, version, source)
        yield source, key


def _check_planned(uri: str, size: object, version: object, source: Source) -> None:
    """Raise :class:`SourceChangedError` unless ``source`` is the version the client planned (if it planned one)."""
    if size is not None and (source.size, source.version) != (size, version):
        raise SourceChangedError(
            f"{uri}: is version {source.version} ({source.size} bytes) now; {version} ({size} bytes) was planned"
        )
