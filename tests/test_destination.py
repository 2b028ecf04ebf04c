"""The destination, decided once (readers/destination.py): the route follows from the options, what the store
declares it can do and the routes the loader offers; what cannot be honoured is refused with a message that says
why, before any read."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weightstream
from tests.cache_daemon import running_daemon
from weightstream.errors import InvalidOptionError
from weightstream.nodecache.client import CachedStore
from weightstream.nodecache.connection import connect
from weightstream.options import LoadOptions
from weightstream.readers.destination import ALL_ROUTES, COPYING_ROUTES, Destination, Route, choose_destination
from weightstream.sources.base import DirectIO, Mapped, SharedMemory
from weightstream.sources.http.store import HttpStore
from weightstream.sources.local.file import LocalStore

CPU = torch.device("cpu")


def test_stores_declare_what_they_can_do():
    with contextlib.closing(HttpStore()) as http:
        assert (isinstance(http, Mapped), isinstance(http, SharedMemory), isinstance(http, DirectIO)) == (
            False,
            False,
            False,
        )
    local = LocalStore()
    assert (isinstance(local, Mapped), isinstance(local, SharedMemory), isinstance(local, DirectIO)) == (
        True,
        False,
        True,
    )


@pytest.mark.parametrize(
    ("options", "routes", "route"),
    [
        ({}, ALL_ROUTES, Route.HOST),
        ({"zero_copy": True}, ALL_ROUTES, Route.VIEWS),
        ({"zero_copy": "auto"}, ALL_ROUTES, Route.HOST),  # views of local files are asked for, never assumed
        ({"pin_memory": "auto"}, COPYING_ROUTES, Route.HOST),  # no CUDA here: nothing to pin with
        ({"direct_io": True}, COPYING_ROUTES, Route.HOST),
    ],
)
def test_local_files_on_the_cpu(options, routes, route):
    assert choose_destination(LocalStore(), "/m", LoadOptions(**options), "x", routes) == Destination(route, CPU)


@pytest.mark.parametrize(
    ("options", "routes", "message"),
    [
        ({"zero_copy": True}, ALL_ROUTES, r"zero_copy=True: http://h/m is an object, not a local file"),
        ({"direct_io": True}, ALL_ROUTES, r"direct_io=True: http://h/m is an object, not a local file"),
        ({"gds": True, "device": "cuda"}, ALL_ROUTES, r"gds=True: http://h/m is an object, not a local file"),
        (
            {"gds": True, "device": "cuda"},
            COPYING_ROUTES,
            r"gds=True: format='x' reaches a GPU through the pinned staging ring, not cuFile",
        ),
    ],
)
def test_what_an_object_store_or_the_loader_cannot_honour_is_refused(options, routes, message):
    with contextlib.closing(HttpStore()) as http, pytest.raises(InvalidOptionError, match=message):
        choose_destination(http, "http://h/m", LoadOptions(**options), "x", routes)


def test_a_loader_without_views_refuses_zero_copy_of_local_files():
    with pytest.raises(
        InvalidOptionError,
        match=r"zero_copy=True: maps whole files, while format='layered' reads into memory of its own; use "
        r"format='safetensors'",
    ):
        choose_destination(LocalStore(), "/m", LoadOptions(zero_copy=True), "layered", COPYING_ROUTES)


def test_through_the_node_cache(tmp_path: Path, no_leaks):
    """The cache's store declares shared memory (views by default on the CPU) and no direct I/O: direct_io=True
    through it is refused as what it is, not as "an object"."""
    save_file({"w": torch.arange(6, dtype=torch.float32)}, str(tmp_path / "model.safetensors"))
    with running_daemon("destination") as daemon:
        client, _ = connect(str(daemon.socket))
        with contextlib.closing(CachedStore(LocalStore(), client, None)) as store:
            assert isinstance(store, SharedMemory) and isinstance(store, Mapped) and not isinstance(store, DirectIO)
            uri = str(tmp_path / "model.safetensors")
            assert choose_destination(store, uri, LoadOptions(), "safetensors") == Destination(Route.VIEWS, CPU)
            assert choose_destination(store, uri, LoadOptions(), "streaming", COPYING_ROUTES) == Destination(
                Route.HOST, CPU
            )
            assert choose_destination(store, uri, LoadOptions(zero_copy=False), "safetensors") == Destination(
                Route.HOST, CPU
            )
        with pytest.raises(
            InvalidOptionError,
            match=r"direct_io=True: .*model.safetensors is read through the node cache \(shared memory, no page "
            r"cache to go around\), not a local file",
        ):
            weightstream.load_weights(tmp_path / "model.safetensors", cache=str(daemon.socket), direct_io=True)
