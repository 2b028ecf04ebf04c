"""The store a plan was made through, kept for reading the plan's tensors.

Opening an object store costs a session and credentials (about 0.15 s with s3fs); a load that
opened one for its headers and another for its tensors paid it twice. A loader keeps the store
of each plan it made and hands it to the read of that plan, which closes it when it ends. A plan
dropped without being read closes its store with it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

from weightstream.options import LoadOptions
from weightstream.planning.plan import LoadPlan
from weightstream.sources import Store, store_for


class PlannedStores:
    """Plan -> the open store it was made through, until the plan is read or dropped.

    Example:
        >>> stores = PlannedStores()
        >>> plan = stores.plan("/tmp", LoadOptions(), lambda store: LoadPlan("/tmp", (), ()))
        >>> type(stores.take(plan, LoadOptions())).__name__
        'LocalStore'
    """

    def __init__(self) -> None:
        self._kept: dict[int, tuple[Store, weakref.finalize]] = {}

    def plan(self, uri: str, opts: LoadOptions, make: Callable[[Store], LoadPlan]) -> LoadPlan:
        """``make(store)`` with a store opened for ``uri``; the store is kept for the plan's read
        (or closed at once if ``make`` raises)."""
        store = store_for(uri, opts.storage_options, opts.retry_policy())
        try:
            plan = make(store)
        except BaseException:
            store.close()
            raise
        # The finaliser must not hold the plan: it runs when the plan dies unread.
        self._kept[id(plan)] = (store, weakref.finalize(plan, _close_unread, self._kept, id(plan)))
        return plan

    def take(self, plan: LoadPlan, opts: LoadOptions) -> Store:
        """The store ``plan`` was made through (the caller closes it), or a new one for a plan made elsewhere."""
        kept = self._kept.pop(id(plan), None)
        if kept is None:
            return store_for(plan.uri, opts.storage_options, opts.retry_policy())
        store, finaliser = kept
        finaliser.detach()
        return store


def _close_unread(kept: dict[int, tuple[Store, weakref.finalize]], key: int) -> None:
    entry = kept.pop(key, None)
    if entry is not None:
        with contextlib.suppress(Exception):  # at garbage collection there is nobody to tell
            entry[0].close()
