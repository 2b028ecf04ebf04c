"""`LoadOptions`: the one set of options every loader receives."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Collection, Mapping
from typing import Literal, TypeVar

import torch

from weightstream.errors import InvalidOptionError, OptionError
from weightstream.sources.retry import RetryPolicy

TensorFilter = Collection[str] | Callable[[str], bool]
"""Names to load: a collection of tensor names, or a predicate on the name."""

ProgressCallback = Callable[[int], None]
"""Called with the number of bytes that just landed (from reader threads)."""

Auto = Literal["auto"]
"""The value of the options that decide for themselves (``direct_io``, ``huge_pages``, ``pin_memory``, ``gds``,
``zero_copy``)."""

LoaderOptions = TypeVar("LoaderOptions")

MIB = 1 << 20
MAX_STAGING_BYTES = 4 << 30
"""Upper bound on ``staging_slots * staging_slot_bytes``: staging is pinned memory."""
LOCAL_CHUNK_BYTES = 8 * MIB
REMOTE_CHUNK_BYTES = 64 * MIB
DEFAULT_INFLIGHT_BYTES = 1 << 30
"""The streaming window (and every CUDA destination's device window) when ``max_inflight_bytes`` is not
given, raised to the largest tensor."""


MAX_DEFAULT_THREADS = 64
"""The default reader threads stop here, however many CPUs (2 x 192 cores would be 384 a rank). Measured
(``benchmarks/README.md``, read loop): with 5 ms per read, 64 threads gave 3,900 reads/s, 128 gave
4,390 and 384 fewer (3,840); with 1 ms, 64 was the best (5,590/s) and more were slower. 64 requests in
flight are 512 MiB locally and 4 GiB remotely, deeper than any NVMe queue or NIC needs."""


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """The core options of one load (destination, I/O, remote), which every loader honours or refuses
    in ``check``; a loader's own options travel in :attr:`loader_options` (see :meth:`own`).

    Build it from keyword arguments with :meth:`from_kwargs`, which rejects unknown
    names before any I/O (``weightstream.registry.bind_options`` adds a loader's own).
    """

    device: str = "cpu"
    """Where tensors land: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (a ``torch.device``, or an integer N for
    ``"cuda:N"``, is taken as its name). A CUDA device this machine lacks raises
    ``DeviceUnavailableError``; other device types (``meta``, ``xpu``, ``mps``, ``hpu``, ...) raise
    ``InvalidOptionError``; nothing falls back to the CPU. Default ``"cpu"``: memory the caller owns."""

    pin_memory: bool | Auto = False
    """Page-locked (pinned) CPU tensors: ``True``, ``False`` (default) or ``"auto"`` (pin when CUDA and
    cuda-python are available; the reason is logged when not). ``True`` without them raises
    ``DeviceUnavailableError``. For CPU destinations only."""

    staging_slots: int = 16
    """CUDA destinations: pinned staging slots in the ring. Default 16: enough for the readers to
    keep filling slots while the copy engine drains others."""

    gds: bool | Auto = False
    """CUDA destinations: GPUDirect Storage through cuFile (reads straight from the file into device
    memory): ``True`` (raise where cuFile cannot open), ``False`` (default: the staging ring), or
    ``"auto"`` (cuFile where the nvidia-fs module makes it real GPUDirect, else the ring, with the
    reason logged). Default ``False`` until a GPU benchmark shows cuFile ahead of the ring."""

    staging_slot_bytes: int = 8 * MIB
    """CUDA destinations: bytes per staging slot (a multiple of 4096). Reads through the ring are at
    most ``min(chunk_bytes, staging_slot_bytes)``. Default 8 MiB, the default ``chunk_bytes`` of local files
    (128 MiB of pinned staging in all). ``staging_slots * staging_slot_bytes`` may not exceed 4 GiB."""

    threads: int | None = None
    """Reader threads. Default ``None``: twice the number of CPUs, at least 8 and at most 64 (a cold direct
    read wants many requests in flight; threads waiting on the disk leave the CPU to the others; past 64
    the read loop gains nothing: measured in ``benchmarks/README.md``, the read loop at scale)."""

    chunk_bytes: int | None = None
    """Largest single read request, in bytes (a multiple of 4096). Default ``None``: 8 MiB for local files,
    64 MiB for object stores and HTTP, where each request costs a round trip and server work (measured in
    ``benchmarks/README.md``); 64 MiB everywhere for ``format="distributed"``, where it is also the broadcast unit."""

    filter: TensorFilter | None = None
    """Only these tensors: a collection of names, or a predicate on the name; only their bytes are read.
    A listed name that is missing raises ``TensorNotFound``. Default ``None``: all of them."""

    direct_io: bool | Auto = "auto"
    """Read with O_DIRECT (skipping the page cache): ``True``, ``False``, or ``"auto"`` (default:
    direct for files mostly not in the page cache, when the filesystem allows it)."""

    huge_pages: bool | Auto = "auto"
    """Ask for transparent huge pages on the destination memory: ``True``, ``False``, or ``"auto"``
    (default: for files read directly). On virtual machines huge pages can come host-cold and are slower to
    fault in than recycled 4 KiB pages, but a direct read pins and fills them faster."""

    prefault: bool = True
    """Each reader faults in the destination pages of its request (``MADV_POPULATE_WRITE``, off the GIL)
    just before reading into them (pinned memory is faulted in already). Default ``True``."""

    zero_copy: bool | Auto = "auto"
    """Return views of a private mapping of each file (a local file, or a segment of the node cache)
    instead of owned memory: no copy and no fresh pages. ``True``, ``False`` (always owned memory) or
    ``"auto"`` (default: views of the node cache's shared memory, owned memory elsewhere). The
    ``safetensors`` and ``sharded-state`` loaders honour it, the others refuse ``True``. Writing to a view
    copies its page privately; truncating a local file while one lives makes reading it fault (SIGBUS).
    On a GPU, ``True`` (with ``cache=``) gives read-only views of the cache daemon's device copies."""

    cache: str | None = None
    """The node weight cache to read through (docs/node-cache.md): the daemon's socket
    path, or ``"auto"`` (``$WEIGHTSTREAM_CACHE`` or the default socket, if a daemon listens there; else
    the source is read directly: logged at DEBUG where no socket exists, as a WARNING otherwise, e.g. a stale
    socket). An explicit socket without a daemon raises ``CacheUnavailableError``. Default ``None``: no
    cache."""

    storage_options: Mapping[str, object] | None = None
    """Remote sources. S3: ``endpoint_url``, ``key``, ``secret``, ``token``, ``region_name``, ``profile``,
    ``anon``, ``client_kwargs``, ``config_kwargs`` (botocore's client; s3fs's names). GCS: options for
    ``gcsfs.GCSFileSystem``. HTTP: only ``{"headers": {...}}`` (e.g. ``Authorization``, sent to the
    URL's own host only). ``hf://``: ``cache_dir``, ``endpoint``, ``token``, ``offline``, ``headers``.
    Default ``None``: the standard environment variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
    ``STORAGE_EMULATOR_HOST``, ``HF_TOKEN``, ...)."""

    retries: int = 5
    """Object stores: further attempts at a range after a transient failure (5xx, SlowDown, a reset
    connection, a stall, a short body), with exponential backoff and jitter; a broken range resumes
    from the byte reached. Authentication, not-found and changed-object errors are never retried.
    Default 5."""

    request_timeout_s: float = 30.0
    """Object stores: seconds a request may go without receiving a byte, or below 64 KiB/s over that
    long, before it counts as stalled (and is retried). Default 30."""

    deadline_s: float | None = None
    """Object stores: seconds the whole read may take before ``SourceTimeout``, enforced inside every read
    too. Default ``None``: no deadline."""

    progress: ProgressCallback | None = None
    """A callable receiving byte counts as reads complete (called from reader threads). Default ``None``."""

    loader_options: object = None
    """The options of the loader reading (an instance of its ``options`` dataclass), set by
    ``weightstream.registry.bind_options``; read them with :meth:`own`. Default ``None``: none given."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", _device_name(self.device))
        _check_device(self.device)
        if self.threads is not None and (not is_int(self.threads) or self.threads < 1):
            raise InvalidOptionError(f"threads must be a positive integer or None, got {self.threads!r}")
        if self.chunk_bytes is not None and (
            not is_int(self.chunk_bytes) or self.chunk_bytes < 4096 or self.chunk_bytes % 4096
        ):
            raise InvalidOptionError(
                f"chunk_bytes must be a positive multiple of 4096 or None, got {self.chunk_bytes!r}"
            )
        for name in ("staging_slots", "staging_slot_bytes"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise InvalidOptionError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.staging_slot_bytes % 4096:
            raise InvalidOptionError(f"staging_slot_bytes must be a multiple of 4096, got {self.staging_slot_bytes}")
        if self.staging_slots * self.staging_slot_bytes > MAX_STAGING_BYTES:
            raise InvalidOptionError(
                f"staging_slots x staging_slot_bytes = {self.staging_slots} x {self.staging_slot_bytes} bytes "
                f"exceeds the {MAX_STAGING_BYTES >> 30} GiB bound on pinned staging"
            )
        if not isinstance(self.prefault, bool):
            raise OptionError(f"prefault must be a bool, got {type(self.prefault).__name__}")
        if self.cache is not None and (not isinstance(self.cache, str) or not self.cache):
            raise OptionError(f"cache must be a socket path, 'auto' or None, got {self.cache!r}")
        for name in ("direct_io", "huge_pages", "pin_memory", "gds", "zero_copy"):
            if not (isinstance(getattr(self, name), bool) or getattr(self, name) == "auto"):
                raise InvalidOptionError(f"{name} must be True, False or 'auto', got {getattr(self, name)!r}")
        on_cpu = torch.device(self.device).type == "cpu"
        if self.pin_memory is True and not on_cpu:
            raise InvalidOptionError(f"pin_memory=True is for CPU destinations; device {self.device!r} is not one")
        if self.gds is True and on_cpu:
            raise InvalidOptionError(f"gds=True reads into GPU memory; device {self.device!r} is not a GPU")
        if self.zero_copy is True and self.pin_memory is True:
            raise InvalidOptionError("zero_copy returns views of a file mapping: it cannot land in pinned memory")
        if self.zero_copy is True and not on_cpu and self.cache is None:
            raise InvalidOptionError(
                "zero_copy=True on a GPU views the node cache daemon's device copies: it needs cache= (a daemon "
                "started with --device); without one, zero_copy cannot land on a GPU"
            )
        if not is_int(self.retries) or self.retries < 0:
            raise InvalidOptionError(f"retries must be a non-negative integer, got {self.retries!r}")
        for name in ("request_timeout_s", "deadline_s"):
            value = getattr(self, name)
            if value is None and name == "deadline_s":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise InvalidOptionError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise OptionError(f"storage_options must be a mapping, got {type(self.storage_options).__name__}")
        if self.progress is not None and not callable(self.progress):
            raise OptionError(f"progress must be callable, got {type(self.progress).__name__}")
        if self.filter is not None:
            object.__setattr__(self, "filter", _normalise_filter(self.filter))

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> LoadOptions:
        """Build options from keyword arguments, rejecting unknown names.

        Example:
            >>> LoadOptions.from_kwargs(threads=4).threads
            4
        """
        known = set(core_option_names())
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise OptionError(f"unknown option(s) {', '.join(unknown)}; known options: {', '.join(sorted(known))}")
        return cls(**kwargs)  # type: ignore[arg-type]  # each field checks its own type in __post_init__

    def request_bytes(self, uri: str) -> int:
        """The largest read request for the checkpoint at ``uri``: ``chunk_bytes``, or its default there.

        Example:
            >>> LoadOptions().request_bytes("/models/llama") >> 20, LoadOptions().request_bytes("s3://b/llama") >> 20
            (8, 64)
        """
        from weightstream.sources import REMOTE_SCHEMES

        if self.chunk_bytes is not None:
            return self.chunk_bytes
        return REMOTE_CHUNK_BYTES if uri.startswith(REMOTE_SCHEMES) else LOCAL_CHUNK_BYTES

    @property
    def reader_threads(self) -> int:
        """The number of reader threads this load uses."""
        return self.threads if self.threads is not None else min(MAX_DEFAULT_THREADS, max(8, 2 * (os.cpu_count() or 1)))

    def retry_policy(self) -> RetryPolicy:
        """How object-store requests of a load starting now are retried (its deadline starts now)."""
        deadline = None if self.deadline_s is None else time.monotonic() + self.deadline_s
        return RetryPolicy(self.retries, self.request_timeout_s, deadline)

    def own(self, kind: type[LoaderOptions]) -> LoaderOptions:
        """This load's options of the loader that declares ``kind``: those given, or ``kind``'s defaults.

        Raises:
            TypeError: the options bound are another loader's (a loader reading options not made for it).

        Example:
            >>> import dataclasses
            >>> @dataclasses.dataclass(frozen=True)
            ... class Window:
            ...     max_bytes: int = 64
            >>> LoadOptions().own(Window).max_bytes, LoadOptions(loader_options=Window(8)).own(Window).max_bytes
            (64, 8)
        """
        if self.loader_options is None:
            return kind()
        if not isinstance(self.loader_options, kind):
            raise TypeError(
                f"options of {kind.__qualname__} asked for, but these hold {type(self.loader_options).__qualname__}"
            )
        return self.loader_options

    def refuse(self, reasons: Mapping[str, str]) -> None:
        """Raise ``InvalidOptionError`` for the first option of ``reasons`` that is set (not its default), with its
        reason.

        Example:
            >>> LoadOptions(zero_copy=True).refuse({"zero_copy": "this loader reads into memory of its own"})
            Traceback (most recent call last):
            ...
            weightstream.errors.InvalidOptionError: zero_copy=True: this loader reads into memory of its own
        """
        for name in changed_fields(self, reasons):
            raise InvalidOptionError(f"{name}={getattr(self, name)!r}: {reasons[name]}")

    def wants(self, name: str) -> bool:
        """Whether the filter selects tensor ``name``."""
        if self.filter is None:
            return True
        if callable(self.filter):
            return bool(self.filter(name))
        return name in self.filter

    @property
    def required(self) -> tuple[str, ...]:
        """The tensor names a list ``filter`` asks for, which must all exist (a callable filter requires none).

        Example:
            >>> LoadOptions(filter=["lm_head.weight"]).required
            ('lm_head.weight',)
        """
        return tuple(self.filter) if self.filter is not None and not callable(self.filter) else ()


def core_option_names() -> tuple[str, ...]:
    """The options every loader receives (the fields of :class:`LoadOptions` a caller sets).

    Example:
        >>> "device" in core_option_names(), "loader_options" in core_option_names()
        (True, False)
    """
    return tuple(field.name for field in dataclasses.fields(LoadOptions) if field.name != "loader_options")


def changed_fields(options: object, names: Collection[str] | None = None) -> list[str]:
    """Which fields of the dataclass ``options`` (or of them, ``names``) differ from their defaults.

    Example:
        >>> changed_fields(LoadOptions(threads=4, zero_copy=True), ["threads", "device"])
        ['threads']
    """
    fields = {field.name: field for field in dataclasses.fields(options)}  # type: ignore[arg-type]
    wanted = fields if names is None else names
    return [name for name in wanted if getattr(options, name) != _default(fields[name])]


def _default(field: dataclasses.Field[object]) -> object:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def is_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool`` (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")
"""Where tensors can land (``meta``, ``xpu``, ``mps``, ``hpu``, ... are refused, not silently loaded to the CPU)."""


def _device_name(device: object) -> object:
    """``device`` as a name: a ``torch.device`` by its name, an integer as that CUDA device (as torch and safetensors
    take them); anything else as it is, for :func:`_check_device` to judge.

    Example:
        >>> _device_name(torch.device("cuda", 1)), _device_name(0), _device_name("cpu")
        ('cuda:1', 'cuda:0', 'cpu')
    """
    if isinstance(device, torch.device):
        return str(device)
    if isinstance(device, int) and not isinstance(device, bool):
        return f"cuda:{device}"
    return device


def _check_device(device: object) -> None:
    if not isinstance(device, str):
        raise OptionError(
            f"device must be a string such as 'cpu' or 'cuda:0' (or a torch.device, or N for 'cuda:N'), got "
            f"{type(device).__name__}"
        )
    try:
        target = torch.device(device)
    except (RuntimeError, ValueError) as error:
        raise InvalidOptionError(f"device {device!r} is not a device torch knows: {error}") from None
    if target.type not in SUPPORTED_DEVICE_TYPES:
        raise InvalidOptionError(
            f"device {device!r}: weightstream lands tensors on {' or '.join(SUPPORTED_DEVICE_TYPES)} devices only; "
            f"nothing falls back to the CPU: load to 'cpu' and move the tensors yourself"
        )
    if target.type == "cpu" and target.index not in (None, 0):
        raise InvalidOptionError(f"device {device!r}: there is one CPU device, 'cpu'")


def _normalise_filter(value: object) -> TensorFilter:
    if callable(value):
        return value
    if isinstance(value, (str, bytes)):
        raise OptionError(
            f"filter must be a collection of names or a predicate, not a single {type(value).__name__} {value!r}"
        )
    if not isinstance(value, Collection):
        raise OptionError(f"filter must be a collection of names or a predicate, got {type(value).__name__}")
    names = frozenset(value)
    bad = [name for name in names if not isinstance(name, str)]
    if bad:
        raise OptionError(f"filter names must be strings, got {bad[0]!r}")
    return names
