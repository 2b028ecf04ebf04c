"""The node cache daemon from Python: what ``weightstream cache ls | stats | evict | prefetch | stop`` do.

Example:
    >>> cache = weightstream.NodeCache()  # doctest: +SKIP
    >>> cache.prefetch("s3://bucket/llama/")["bytes"]  # doctest: +SKIP
    16060522496
    >>> [entry["uri"] for entry in cache.ls()]  # doctest: +SKIP
    ['s3://bucket/llama/model-00001-of-00004.safetensors', ...]
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping

from weightstream.errors import CacheError, DeviceUnavailableError, redact
from weightstream.nodecache.connection import CacheClient, daemon_uri, resolve_socket
from weightstream.nodecache.protocol import KEY, close_all

STOP_WAIT_S = 120.0
"""How long :meth:`NodeCache.stop` waits with ``wait=True`` (the daemon gives fills ``--stop-timeout``, 30 s by
default)."""


class NodeCache:
    """The cache daemon at ``socket`` (``"auto"``: ``$WEIGHTSTREAM_CACHE``, else the default socket). Each call opens
    its own connection, checked to be served by a trusted user, and closes it.

    Raises (any method):
        CacheUnavailableError: no daemon answers at the socket.
        CacheRefusedError: another user listens there, or the daemon refused this process.
    """

    def __init__(self, socket: str | os.PathLike[str] = "auto") -> None:
        self.socket = resolve_socket(os.fspath(socket))[0]

    def __repr__(self) -> str:
        return f"NodeCache({self.socket!r})"

    def ls(self) -> list[dict[str, object]]:
        """The entries: each a dict with its ``key``, ``uri``, ``size``, ``version``, ``last_used``,
        ``filled_seconds`` and ``references`` (the processes using it)."""
        return self._ask({"op": "ls"})["entries"]  # type: ignore[return-value]

    def stats(self) -> dict[str, object]:
        """The daemon's state and counters: ``socket``, ``directory``, ``budget``, ``entries``, ``bytes``, ``filling``,
        ``referenced_entries``, ``clients``, ``devices``, and its hit, fill and eviction counts."""
        return self._ask({"op": "stats"})

    def evict(self, entry: str | os.PathLike[str] | None = None, *, all: bool = False) -> dict[str, object]:
        """Remove entries no process uses: one by key, those of a URI (a file, or every file under a directory), or
        every one (``all=True``). Returns ``{"evicted": [keys], "kept_referenced": [keys still in use]}``.

        Raises:
            CacheError: neither ``entry`` nor ``all`` given, or both.
        """
        if (entry is None) == (not all):
            raise CacheError("evict: name a key or a URI, or pass all=True for every entry no process uses")
        if all:
            return self._ask({"op": "evict", "all": True})
        name = os.fspath(entry)  # type: ignore[arg-type]
        is_key = KEY.match(name) is not None
        return self._ask({"op": "evict", "key": name} if is_key else {"op": "evict", "uri": daemon_uri(name)})

    def prefetch(
        self,
        uri: str | os.PathLike[str],
        format: str = "auto",
        *,
        device: str | None = None,
        storage_options: Mapping[str, object] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, object]:
        """Fill the cache with a checkpoint before its engine starts: every file, once the daemon has room for all of
        them (a node warmed by halves is cold); with ``device="cuda:N"``, the daemon's copies on that GPU too.
        ``progress(nbytes, total)`` is called with each file's bytes once it is cached, and the checkpoint's.
        Returns ``{"uri", "files", "bytes", "keys", "device"}``.

        Raises:
            CacheFullError: the checkpoint does not fit the daemon's budget.
            CacheError: ``device`` is a GPU the daemon keeps no copies on.
            the errors of :func:`weightstream.open` for the checkpoint.
        """
        from weightstream.checkpoint.opening import open as open_checkpoint

        location = os.fspath(uri)
        options = {"storage_options": dict(storage_options)} if storage_options else {}
        device_option = {} if device is None else {"device": device}
        uuid = None
        if device is not None:
            with contextlib.suppress(DeviceUnavailableError):  # raised once the host tier is filled (_check_device)
                uuid = self._device_uuid(device)
        with open_checkpoint(location, format, filter=(), **options) as planned:
            files = [(spec.path, spec.size) for spec in planned.plan.files]
        total = sum(size for _, size in files)
        keys: list[str] = []
        gpus: object = []
        client = CacheClient(self.socket)
        try:
            client.request({"op": "room", "bytes": total, "uri": daemon_uri(location)})
            # A daemon keeping copies on the GPU is asked for them with each file: in a fleet it may then fill both
            # from a peer's copy on its GPU (GPU to GPU); it keeps the copies for the load that follows.
            served = uuid is not None and uuid in dict(client.request({"op": "stats"})[0].get("devices") or {})
            for path, size in files:
                if served:
                    message = {"op": "device", "uri": path, "size": None, "version": None, "gpu": uuid}
                    answer, fds = client.request_file({**message, "storage_options": dict(storage_options or {})})
                else:
                    answer, fds = client.attach(path, storage_options=storage_options)
                close_all(fds)
                keys.append(str(answer["key"]))
                gpus = answer.get("gpus")
                if progress is not None:
                    progress(size, total)
        finally:
            client.close()
        if device is not None:
            self._check_device(device, gpus)
        # Opened through the cache as a load opens it: what else a load reads (the shard index) is cached too, and
        # with a device, the daemon's copies on it are made (on the first request for each file).
        with open_checkpoint(location, format, filter=(), cache=self.socket, **options, **device_option):
            pass
        return {"uri": redact(location), "files": len(files), "bytes": total, "keys": keys, "device": device}

    def stop(self, *, wait: bool = False) -> dict[str, object]:
        """Ask the daemon to stop (fills in progress get its ``--stop-timeout``); with ``wait``, return once its
        socket is gone.

        Raises:
            CacheError: the daemon did not stop within ``STOP_WAIT_S``.
        """
        answer = self._ask({"op": "stop"})
        if wait:
            deadline = time.monotonic() + STOP_WAIT_S
            while os.path.exists(self.socket):
                if time.monotonic() > deadline:
                    raise CacheError(f"the cache daemon at {self.socket} did not stop within {STOP_WAIT_S:.0f} s")
                time.sleep(0.05)
            answer["stopped"] = True
        return answer

    def _ask(self, message: Mapping[str, object]) -> dict[str, object]:
        """The daemon's answer to ``message``, less its ``ok``."""
        client = CacheClient(self.socket)
        try:
            answer, fds = client.request(message)
            close_all(fds)
        finally:
            client.close()
        answer.pop("ok", None)
        return answer

    def _device_uuid(self, device: str) -> str:
        """The UUID of GPU ``device`` (``cuda:N``).

        Raises:
            DeviceUnavailableError: ``device`` is no GPU, or there is none.
        """
        import torch

        from weightstream.nodecache.vmm import gpu_uuid

        target = torch.device(device)
        if target.type != "cuda":
            raise DeviceUnavailableError(f"device={device!r}: name a GPU as cuda:N")
        return gpu_uuid(target.index if target.index is not None else 0)

    def _check_device(self, device: str, gpus: object) -> None:
        """Refuse a ``device`` the daemon keeps no copies on."""
        uuid = self._device_uuid(device)
        if not isinstance(gpus, list) or uuid not in gpus:
            raise CacheError(
                f"the cache daemon keeps no device copies on {device} ({uuid}); it serves {gpus or 'none'}"
            )
