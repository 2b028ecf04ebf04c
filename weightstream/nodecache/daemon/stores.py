"""The stores the daemon reads remote sources through: one per scheme and set of storage options, at most
:data:`MAX_STORES` kept open, the least recently used closed first once no fill uses it.

A store holds connections (and, for object stores, a client with its own pool): one kept per distinct options
forever would let clients that vary a header exhaust the daemon's descriptors.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping

from weightstream.sources import store_for
from weightstream.sources.base import Store
from weightstream.sources.retry import RetryPolicy

MAX_STORES = 16
"""Stores kept open at most (those in use by a fill are never closed under it)."""


class StorePool:
    """Stores by scheme and options, bounded (see the module's description).

    Example:
        >>> pool = StorePool()
        >>> with pool.borrow("https://example.invalid/m.safetensors", {}) as store:
        ...     type(store).__name__
        'HttpStore'
        >>> pool.close()
    """

    def __init__(self, limit: int = MAX_STORES) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._stores: OrderedDict[str, Store] = OrderedDict()
        self._users: dict[str, int] = {}
        self._retired: dict[str, Store] = {}
        """Stores past the limit that a fill still uses: closed when it is done."""

    def __len__(self) -> int:
        with self._lock:
            return len(self._stores) + len(self._retired)

    @contextlib.contextmanager
    def borrow(self, uri: str, storage_options: Mapping[str, object]) -> Iterator[Store]:
        """The store for ``uri`` with ``storage_options``, kept open while the ``with`` block runs."""
        identity = json.dumps([uri.split("://", 1)[0], storage_options], sort_keys=True)
        with self._lock:
            store = self._stores.get(identity) or self._retired.pop(identity, None)
            if store is None:
                store = store_for(uri, storage_options, RetryPolicy(5, 30.0, None))
            self._stores[identity] = store
            self._stores.move_to_end(identity)
            self._users[identity] = self._users.get(identity, 0) + 1
            closing = self._trim()
        _close_all(closing)
        try:
            yield store
        finally:
            with self._lock:
                self._users[identity] -= 1
                done = not self._users[identity]
                if done:
                    del self._users[identity]
                retired = self._retired.pop(identity) if done and identity in self._retired else None
            _close_all([retired] if retired is not None else [])

    def close(self) -> None:
        """Close every store (the daemon calls this once its fills are over)."""
        with self._lock:
            closing = [*self._stores.values(), *self._retired.values()]
            self._stores.clear()
            self._retired.clear()
        _close_all(closing)

    def _trim(self) -> list[Store]:
        """Under the lock: the stores over the limit, least recently used first, to close now (those in use are
        retired instead, and closed by their last user)."""
        closing = []
        while len(self._stores) > self.limit:
            identity, store = self._stores.popitem(last=False)
            if self._users.get(identity):
                self._retired[identity] = store
            else:
                closing.append(store)
        return closing


def _close_all(stores: list[Store]) -> None:
    for store in stores:
        with contextlib.suppress(Exception):  # a store that fails to close must not take the daemon down
            store.close()
