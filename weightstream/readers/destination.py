"""Where a load's bytes land, decided once: from the destination asked for (device, pinning, ``zero_copy``, ``gds``,
``direct_io``), what the store declares it can do (:class:`~weightstream.sources.base.Mapped`,
:class:`~weightstream.sources.base.SharedMemory`, :class:`~weightstream.sources.base.DirectIO`) and the routes the
loader offers. Every loader asks :func:`choose_destination` and hands its answer to its reader; no reader decides
again.

Routes: ``views`` (tensors view mapped files or the node cache's shared memory, no copy), ``host`` (pageable memory
the caller owns), ``pinned`` (page-locked host memory), ``staged`` (a GPU, through the ring of pinned staging slots),
``gds`` (a GPU, straight from local files through cuFile).
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from weightstream.errors import DeviceUnavailableError, InvalidOptionError, logger
from weightstream.memory.devices import check_destination
from weightstream.options import LoadOptions
from weightstream.sources.base import DirectIO, Mapped, SharedMemory, Store

log = logger(__name__)


class Route(enum.Enum):
    """How bytes reach their destination."""

    VIEWS = "views"
    HOST = "host"
    PINNED = "pinned"
    STAGED = "staged"
    GDS = "gds"


ALL_ROUTES = frozenset(Route)
COPYING_ROUTES = frozenset({Route.HOST, Route.PINNED, Route.STAGED})
"""What a loader that reads into memory of its own offers (no views of whole files, no cuFile)."""


@dataclasses.dataclass(frozen=True)
class Destination:
    """The route a load takes and the device its tensors end on.

    Example:
        >>> from weightstream.sources.local.file import LocalStore
        >>> choose_destination(LocalStore(), "m.safetensors", LoadOptions(zero_copy=False), "safetensors")
        Destination(route=<Route.HOST: 'host'>, device=device(type='cpu'))
    """

    route: Route
    device: torch.device

    @property
    def pinned(self) -> bool:
        """Whether host memory of this load is page-locked (``pinned``; the staging ring pins its own)."""
        return self.route is Route.PINNED

    @property
    def on_gpu(self) -> bool:
        """Whether tensors end on a CUDA device."""
        return self.device.type == "cuda"


def choose_destination(
    store: Store, uri: str, opts: LoadOptions, loader: str, routes: frozenset[Route] = ALL_ROUTES
) -> Destination:
    """The one route of a load of ``uri`` from ``store`` with ``opts`` by the loader named ``loader``, which offers
    ``routes``.

    Raises:
        DeviceUnavailableError: the device, pinned memory or GPUDirect Storage asked for is not on this machine.
        InvalidOptionError: an option the store or the loader cannot honour (``zero_copy=True`` of an object,
            ``direct_io=True`` through the node cache, ``gds=True`` with a loader that stages): refused, never
            ignored.
    """
    _refuse_what_cannot_be_honoured(store, uri, opts, loader, routes)
    pinned = check_destination(opts.device, opts.pin_memory)
    device = _device(opts)
    if opts.zero_copy is True:
        if device.type == "cuda" and not isinstance(store, SharedMemory):
            raise DeviceUnavailableError(
                f"zero_copy=True on {device}: {uri} is not read through a node cache daemon (cache= found none), "
                "whose device copies it would view"
            )
        return Destination(Route.VIEWS, device)
    if (
        opts.zero_copy == "auto"
        and Route.VIEWS in routes
        and isinstance(store, SharedMemory)
        and device.type == "cpu"
        and not pinned
    ):
        return Destination(Route.VIEWS, device)
    if device.type == "cuda":
        return Destination(_gpu_route(store, uri, opts, loader, routes), device)
    return Destination(Route.PINNED if pinned else Route.HOST, device)


def _refuse_what_cannot_be_honoured(
    store: Store, uri: str, opts: LoadOptions, loader: str, routes: frozenset[Route]
) -> None:
    """Options the store or the loader can never honour, whatever this machine has: refused, never ignored."""
    if opts.direct_io is True and not isinstance(store, DirectIO):
        raise InvalidOptionError(f"direct_io=True: {uri} is {_kind(store)}")
    if opts.zero_copy is True:
        if not isinstance(store, (Mapped, SharedMemory)):
            raise InvalidOptionError(f"zero_copy=True: {uri} is {_kind(store)}")
        if Route.VIEWS not in routes:
            raise InvalidOptionError(
                f"zero_copy=True: maps whole files, while format={loader!r} reads into memory of its own; use "
                "format='safetensors'"
            )
    if opts.gds is True and torch.device(opts.device).type == "cuda":
        if Route.GDS not in routes:
            raise InvalidOptionError(
                f"gds=True: format={loader!r} reaches a GPU through the pinned staging ring, not cuFile"
            )
        if not isinstance(store, DirectIO):
            raise InvalidOptionError(f"gds=True: {uri} is {_kind(store)}")


def _device(opts: LoadOptions) -> torch.device:
    """The destination device, a GPU with its index (the current device where none was given)."""
    device = torch.device(opts.device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _gpu_route(store: Store, uri: str, opts: LoadOptions, loader: str, routes: frozenset[Route]) -> Route:
    """GPUDirect Storage when asked for (and, on ``"auto"``, available), else the staging ring."""
    if opts.gds is False:
        return Route.STAGED
    if Route.GDS not in routes:
        log.info("gds='auto': format=%r reads through the staging ring", loader)
        return Route.STAGED
    if not isinstance(store, DirectIO):
        log.info("gds='auto': %s is not a local file; reading through the staging ring", uri)
        return Route.STAGED
    from weightstream.memory import gds

    reason = gds.unavailable_reason(need_nvidia_fs=opts.gds == "auto")
    if reason is None:
        return Route.GDS
    if opts.gds is True:
        raise DeviceUnavailableError(f"gds=True: GPUDirect Storage is not available: {reason}")
    log.info("gds='auto': reading through the staging ring: %s", reason)
    return Route.STAGED


def _kind(store: Store) -> str:
    """What a store's files are, in words, from what it declares, for the message of an option only local files
    take."""
    if isinstance(store, SharedMemory):
        return "read through the node cache (shared memory, no page cache to go around), not a local file"
    return "an object, not a local file"
