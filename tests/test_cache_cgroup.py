"""The cache daemon's memory cgroup: shared memory is charged to the cgroup that first touches it (the daemon's),
so a fill its cgroup cannot hold is refused before any byte is read, never left to the kernel's OOM killer.

A real daemon in a memory cgroup of the test's own where this machine lets one be made (cgroup v1 here), and the
reading of cgroup v1 and v2 files (limits of ancestors included) on directories laid out as the kernel does."""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cache_daemon import ROOT, places, remove, stats
from weightstream.errors import CacheFullError
from weightstream.nodecache.daemon.limits import MEMORY_RESERVE_BYTES, cgroup_room

MiB = 1 << 20


def write_cgroup(root: Path, relative: str, files: dict[str, str]) -> None:
    directory = root / relative.lstrip("/")
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def test_cgroup_v2_room_is_the_least_of_the_cgroup_and_its_ancestors(tmp_path: Path):
    (tmp_path / "cgroup").write_text("0::/system.slice/cache.service\n")
    mount = tmp_path / "fs"
    write_cgroup(mount, "/", {"memory.max": "max\n", "memory.current": "0\n"})
    write_cgroup(mount, "/system.slice", {"memory.max": "1000\n", "memory.current": "900\n"})
    write_cgroup(mount, "/system.slice/cache.service", {"memory.max": "5000\n", "memory.current": "1000\n"})
    assert cgroup_room(str(tmp_path / "cgroup"), str(mount)) == 100
    write_cgroup(mount, "/system.slice", {"memory.max": "max\n"})
    assert cgroup_room(str(tmp_path / "cgroup"), str(mount)) == 4000


def test_cgroup_v1_room_reads_the_memory_hierarchy_and_ignores_its_no_limit_value(tmp_path: Path):
    (tmp_path / "cgroup").write_text("9:name=systemd:/\n4:memory:/pods/cache\n3:cpu,cpuacct:/\n")
    mount = tmp_path / "fs"
    unlimited = {"memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": "5\n"}
    write_cgroup(mount, "/memory", unlimited)
    write_cgroup(mount, "/memory/pods", unlimited)
    write_cgroup(mount, "/memory/pods/cache", {"memory.limit_in_bytes": "4096\n", "memory.usage_in_bytes": "96\n"})
    assert cgroup_room(str(tmp_path / "cgroup"), str(mount)) == 4000
    write_cgroup(mount, "/memory/pods/cache", unlimited)
    assert cgroup_room(str(tmp_path / "cgroup"), str(mount)) is None


def test_no_cgroup_or_unreadable_files_mean_no_limit(tmp_path: Path):
    assert cgroup_room(str(tmp_path / "absent"), str(tmp_path)) is None
    (tmp_path / "cgroup").write_text("0::/a\n")
    write_cgroup(tmp_path / "fs", "/a", {"memory.max": "garbage\n", "memory.current": "1\n"})
    assert cgroup_room(str(tmp_path / "cgroup"), str(tmp_path / "fs")) is None


def own_memory_cgroup() -> Path | None:
    """A fresh child of this process's memory cgroup (v1), or None where this machine does not allow one."""
    with open("/proc/self/cgroup") as cgroup:
        paths = [line.rstrip("\n").split(":", 2) for line in cgroup]
    memory = next((path for _, controllers, path in paths if "memory" in controllers.split(",")), None)
    if memory is None:
        return None
    child = Path("/sys/fs/cgroup/memory") / memory.lstrip("/") / f"wstest-{secrets.token_hex(4)}"
    try:
        child.mkdir()
    except OSError:
        return None
    return child


def test_a_fill_the_daemons_cgroup_cannot_hold_is_refused_before_any_read_and_the_daemon_lives(tmp_path: Path):
    cgroup = own_memory_cgroup()
    if cgroup is None:
        pytest.skip("this machine lets no memory cgroup (v1) be made here")
    directory, socket_path = places("cg")
    small, large = tmp_path / "small.bin", tmp_path / "large.bin"
    small.write_bytes(os.urandom(16 * MiB))
    large.write_bytes(os.urandom(96 * MiB))
    command = [sys.executable, "-m", "weightstream.cli", "cache", "serve", "--dir", str(directory)]
    command += ["--socket", str(socket_path), "--json"]
    # The shell joins the cgroup, then becomes the daemon: every page the daemon touches is charged there.
    joined = f"echo $$ > {cgroup / 'cgroup.procs'} && exec {shlex.join(command)}"
    daemon = subprocess.Popen(["sh", "-c", joined], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert daemon.stdout.readline(), daemon.stderr.read()
        usage = int((cgroup / "memory.usage_in_bytes").read_text())
        # Room for 48 MiB more above the reserve the daemon keeps free: the small file fits, the large does not.
        (cgroup / "memory.limit_in_bytes").write_text(str(usage + MEMORY_RESERVE_BYTES + 48 * MiB))
        sock = str(socket_path)
        refused = r"large\.bin: 100663296 bytes do not fit the cache: the daemon's memory cgroup may be charged \d+"
        with pytest.raises(CacheFullError, match=refused):
            request_attach(sock, large)
        request_attach(sock, small)
        counters = stats(socket_path)
        assert (counters["entries"], counters["fills"], counters["bytes_filled"]) == (1, 1, 16 * MiB)
        assert daemon.poll() is None, "the daemon was not killed"
        oom = dict(line.split() for line in (cgroup / "memory.oom_control").read_text().splitlines())
        assert oom.get("oom_kill", "0") == "0" and oom["under_oom"] == "0"
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        daemon.stdout.close()
        daemon.stderr.close()
        remove(directory, socket_path)
        cgroup.rmdir()


def request_attach(socket_path: str, path: Path) -> None:
    from weightstream.nodecache.connection import CacheClient

    client = CacheClient(socket_path)
    try:
        _, fds = client.attach(str(path))
        for fd in fds:
            os.close(fd)
    finally:
        client.close()
