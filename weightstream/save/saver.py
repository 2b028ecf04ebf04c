"""Saving one rank's sharded state, atomically.

A save writes its parts to hidden temporary names (``O_EXCL``, fsync), then, holding the
directory's save lock (``flock`` on the directory itself, so no lock file is left behind; saves
of other ranks wait only for these renames), sets the rank's saving marker, removes its manifest, renames
the parts into place, deletes parts a previous save left beyond the new count, fsyncs the
directory, writes the manifest (temporary name, fsync, rename, fsync) and removes the marker.

A crash before the marker leaves the previous state (and hidden temporary files, swept by the
next save once their writer is dead); a crash after it leaves the marker, which the loader
refuses: never a mix of two saves. Two saves of one rank at once serialise on the lock (released
by the kernel if the holder dies), so the last one wins, complete. A load running while its rank is
saved again sees the manifest change and raises rather than return tensors of two saves. A write that fails (a
full disk) removes every temporary file and raises ``SaveError``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
from collections.abc import Callable, Iterator, Mapping

import torch

from weightstream.errors import InvalidOptionError, OptionError, SaveError
from weightstream.formats.encoding import encode_header, tensor_pieces
from weightstream.formats.manifest import (
    CHECKSUMS,
    FileEntry,
    Manifest,
    TensorEntry,
    encode_manifest,
    manifest_name,
    new_hasher,
    saving_marker_name,
)
from weightstream.formats.sharded_state import DEFAULT_PATTERN, Rank, ShardPattern, check_in_world, describe

DEFAULT_MAX_FILE_BYTES = 5 << 30
"""vLLM's default part size."""
TEMP_MARK = ".tmp-"


def save_sharded_state(
    state_dict: Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
    *,
    rank: Rank,
    world_size: Rank,
    pattern: str = DEFAULT_PATTERN,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    checksum: str = "xxh3-128",
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Save ``state_dict`` as rank ``rank``'s files in ``directory``, atomically, manifest last.

    Tensors go into parts of at most ``max_file_bytes`` (a larger tensor gets a part of its own), in
    ``state_dict`` order, named by ``pattern`` (``{rank}``, or ``{pp_rank}`` and ``{tp_rank}`` with a
    ``(pp_rank, tp_rank)`` rank, and ``{part}`` from 0), as vLLM's and SGLang's ``sharded_state``
    loaders expect. ``progress`` is called with each count of bytes written. Returns the paths of the parts.

    Raises:
        SaveError: writing failed (e.g. the disk is full); no temporary file is left behind.
        InvalidOptionError, OptionError: bad arguments, before anything is written.

    Example:
        >>> save_sharded_state(model.state_dict(), "llama-tp2/", rank=rank, world_size=2)  # doctest: +SKIP
        ['llama-tp2/model-rank-0-part-0.safetensors']
    """
    shards = ShardPattern(pattern)
    rank = shards.check_rank(rank)
    world_size = shards.check_rank(world_size, "world_size")
    check_in_world(rank, world_size)
    if not isinstance(max_file_bytes, int) or isinstance(max_file_bytes, bool) or max_file_bytes < 1:
        raise InvalidOptionError(f"max_file_bytes must be a positive integer, got {max_file_bytes!r}")
    if checksum not in CHECKSUMS:
        raise InvalidOptionError(f"checksum must be one of {', '.join(CHECKSUMS)}, got {checksum!r}")
    _check_state_dict(state_dict)
    directory = os.fspath(directory)
    token = f"{os.getpid()}-{secrets.token_hex(6)}"
    temporary: list[str] = []
    try:
        _make_directory(directory)
        entries = []
        for number, tensors in enumerate(_parts(state_dict, max_file_bytes)):
            name = shards.name(rank, number)
            temporary.append(os.path.join(directory, f".{name}{TEMP_MARK}{token}"))
            entries.append(_write_part(temporary[-1], name, tensors, checksum, progress))
        with _save_lock(directory):
            _sweep_dead_temporaries(directory, shards, rank)
            marker = os.path.join(directory, saving_marker_name(rank))
            _write_atomically(marker, token.encode(), token)
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, manifest_name(rank)))
            _fsync_directory(directory)
            for path, entry in zip(temporary, entries, strict=True):
                os.replace(path, os.path.join(directory, entry.name))
            temporary.clear()
            for name in os.listdir(directory):
                parsed = shards.parse(name)
                if parsed is not None and parsed[0] == rank and parsed[1] >= len(entries):
                    os.remove(os.path.join(directory, name))  # a part of an earlier, larger save
            _fsync_directory(directory)
            manifest = Manifest(shards.pattern, rank, world_size, checksum, tuple(entries))
            _write_atomically(os.path.join(directory, manifest_name(rank)), encode_manifest(manifest), token)
            os.remove(marker)
            _fsync_directory(directory)
    except SaveError:
        raise
    except OSError as error:
        failure = SaveError(
            f"saving {describe(rank)} into {directory} failed: {error.strerror or error} "
            f"({error.filename or directory})"
        )
        failure.errno = error.errno
        raise failure from error
    finally:
        for path in temporary:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return [os.path.join(directory, entry.name) for entry in entries]


def _check_state_dict(state_dict: object) -> None:
    if not isinstance(state_dict, Mapping):
        raise OptionError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    for name, tensor in state_dict.items():
        if not isinstance(name, str) or not name:
            raise OptionError(f"state_dict keys must be non-empty strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise OptionError(f"state_dict[{name!r}] is a {type(tensor).__name__}, not a tensor")
        if tensor.layout is not torch.strided:
            raise InvalidOptionError(
                f"state_dict[{name!r}] is a {tensor.layout} tensor; only dense tensors can be saved"
            )


def _parts(state_dict: Mapping[str, torch.Tensor], max_file_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """The state dict in order, cut into parts of at most ``max_file_bytes`` of tensor data (never empty)."""
    part: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if part and size + nbytes > max_file_bytes:
            yield part
            part, size = {}, 0
        part[name] = tensor
        size += nbytes
    if part or not state_dict:
        yield part


def _write_part(
    path: str, name: str, tensors: dict[str, torch.Tensor], checksum: str, progress: Callable[[int], None] | None
) -> FileEntry:
    """Write one part to ``path`` (a new file), fsync it, and describe it for the manifest."""
    header = encode_header(tensors, {"format": "pt"})
    whole, header_hash = new_hasher(checksum), new_hasher(checksum)
    whole.update(header)
    header_hash.update(header)
    entries, offset = [], len(header)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    with open(descriptor, "wb", buffering=0) as file:
        _write_all(file, memoryview(header))
        for tensor_name, tensor in tensors.items():
            tensor_hash = new_hasher(checksum)
            nbytes = 0
            for piece in tensor_pieces(tensor):
                _write_all(file, piece)
                whole.update(piece)
                tensor_hash.update(piece)
                nbytes += len(piece)
                if progress is not None:
                    progress(len(piece))
            entries.append(TensorEntry(tensor_name, offset, nbytes, tensor_hash.hexdigest()))
            offset += nbytes
        os.fsync(file.fileno())
    return FileEntry(name, offset, whole.hexdigest(), header_hash.hexdigest(), tuple(entries))


def _write_all(file, data: memoryview) -> None:
    written = 0
    while written < len(data):
        count = file.write(data[written:])
        if not count:
            raise OSError(errno.EIO, f"write returned {count} after {written} of {len(data)} bytes", file.name)
        written += count


def _write_atomically(path: str, data: bytes, token: str) -> None:
    """``data`` at ``path`` or not at all: a temporary name, fsync, rename, fsync of the directory."""
    directory, name = os.path.split(path)
    temporary = os.path.join(directory, f".{name.lstrip('.')}{TEMP_MARK}{token}")
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        with open(descriptor, "wb", buffering=0) as file:
            _write_all(file, memoryview(data))
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _make_directory(directory: str) -> None:
    """Create ``directory`` (and its parents) unless it is one; a file in the way is a :class:`SaveError`."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        failure = SaveError(f"cannot save into {directory}: it is a file, not a directory")
        failure.errno = errno.ENOTDIR
        raise failure
    os.makedirs(directory, exist_ok=True)


@contextlib.contextmanager
def _save_lock(directory: str) -> Iterator[None]:
    """The directory's save lock: ``flock`` on the directory itself, which the kernel releases if the
    holder dies, and which leaves no file behind."""
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def _sweep_dead_temporaries(directory: str, shards: ShardPattern, rank: Rank) -> None:
    """Remove the rank's temporary files whose writing process no longer runs (a save killed midway)."""
    for name in os.listdir(directory):
        if not name.startswith(".") or TEMP_MARK not in name:
            continue
        final, _, token = name[1:].rpartition(TEMP_MARK)
        parsed = shards.parse(final)
        mine = (parsed is not None and parsed[0] == rank) or final in (
            manifest_name(rank),
            saving_marker_name(rank).lstrip("."),
        )
        pid = token.split("-", 1)[0]
        if mine and pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
