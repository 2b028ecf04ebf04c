"""What the fsspec-listed object stores share (GCS through gcsfs, Azure through adlfs): metadata from the
filesystem's listings, each entry's type, size and version kept from the listing that showed it, so a load
asks about each object once and reads stay pinned to the version the listing saw."""

from __future__ import annotations

from typing import Any, ClassVar

from weightstream.errors import NotFound, SourceError
from weightstream.sources.objects.versioned import RangeSource, RemoteStore


class ListedStore(RemoteStore):
    """A remote store whose metadata calls go to an fsspec filesystem (:meth:`_metadata`), each object opened at
    the version its listing (or ``info``) names under :attr:`version_key`."""

    version_key: ClassVar[str]
    """The field of an entry that names its version (``generation``, ``etag``)."""
    noun: ClassVar[str] = "object"
    """What the store calls an object, for messages."""
    fresh_listing: ClassVar[dict[str, Any]] = {"refresh": True}
    """What makes the filesystem's ``ls`` ask the store rather than its cache."""

    def __init__(self, policy: Any) -> None:
        super().__init__(policy)
        self._listed: dict[str, dict] = {}
        """URI -> its entry in a listing this store made (a load's snapshot; reads stay pinned to its versions)."""

    def is_dir(self, uri: str) -> bool:
        listed = self._listed.get(uri.rstrip("/"))
        if listed is not None:
            return listed.get("type") == "directory"
        return bool(self._metadata(uri, "isdir"))

    def exists(self, uri: str) -> bool:
        return uri.rstrip("/") in self._listed or bool(self._metadata(uri, "exists"))

    def list_names(self, uri: str) -> list[str]:
        """The entries of prefix ``uri``; what the listing says of each (type, size, version) answers later
        questions about them in this store without another request."""
        entries = self._metadata(uri, "ls", detail=True, **self.fresh_listing)
        names = []
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            self._listed[self.join(uri, name)] = entry
            names.append(name)
        return sorted(names)

    def open(self, uri: str, *, direct: bool | str = False) -> RangeSource:
        """Open ``uri`` at its current version (``direct`` has no meaning for objects and is ignored)."""
        info = self._listed.get(uri.rstrip("/"))
        if info is None or not info.get(self.version_key):
            info = self._metadata(uri, "info", refresh=True)
        if info.get("type") == "directory":
            raise NotFound(f"{uri}: is a prefix, not {'an' if self.noun[0] in 'aeiou' else 'a'} {self.noun}")
        if not info.get(self.version_key):
            raise SourceError(f"{uri}: the store gave no {self.version_key}, so reads cannot be pinned to one version")
        return RangeSource(self, uri, int(info["size"]), str(info[self.version_key]))

    def _metadata(self, uri: str, call: str, **options: Any) -> Any:
        """The filesystem's ``call`` (``isdir``, ``exists``, ``ls``, ``info``) on ``uri``, retried as the store's
        policy says."""
        raise NotImplementedError
