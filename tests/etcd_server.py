"""A real etcd for the fleet tests: Debian's ``etcd-server`` (3.4), fetched with ``apt-get download`` (or found in
``.whl/``, where ``benchmarks/gpu_check.sh prepare`` puts it for a machine without a network) and unpacked into
``~/.cache/weightstream`` on first use, started on loopback ports of its own."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.netns import HUB_ADDRESS, Network
from tests.objstore import _wait_for, free_port, stop, tempfile_directory

PACKAGE = "etcd-server"
CARRIED = Path(__file__).resolve().parents[1] / ".whl"


def etcd_binary() -> str:
    prefix = Path.home() / ".cache" / "weightstream" / PACKAGE
    binary = prefix / "usr" / "bin" / "etcd"
    if not binary.exists():
        with tempfile_directory() as scratch:
            carried = sorted(CARRIED.glob(f"{PACKAGE}_*.deb"))
            if not carried:
                download = ["apt-get", "download", PACKAGE]
                subprocess.run(download, cwd=scratch, check=True, capture_output=True, timeout=300)
            (package,) = carried or Path(scratch).glob(f"{PACKAGE}_*.deb")
            subprocess.run(["dpkg", "-x", str(package), str(prefix)], check=True, capture_output=True, timeout=300)
    return str(binary)


@contextlib.contextmanager
def etcd_server(directory: Path, network: Network | None = None) -> Iterator[str]:
    """etcd with its data in ``directory``; yields its client URL (``http://127.0.0.1:PORT``, or on ``network``'s hub
    when one is given: ``http://10.213.0.1:2379``, reachable from its machines only)."""
    if network is None:
        host, client, peer, wrap, inside = "127.0.0.1", free_port(), free_port(), [], contextlib.nullcontext()
    else:
        host, client, peer, inside = HUB_ADDRESS, 2379, 2380, network.inside()
        wrap = ["ip", "netns", "exec", network.hub]
    url = f"http://{host}:{client}"
    log = directory / "etcd.log"
    with open(log, "w") as output:
        process = subprocess.Popen(
            [
                *wrap,
                etcd_binary(),
                "--name", "weightstream-test",
                "--data-dir", str(directory / "data"),
                "--listen-client-urls", url,
                "--advertise-client-urls", url,
                "--listen-peer-urls", f"http://{host}:{peer}",
                "--initial-advertise-peer-urls", f"http://{host}:{peer}",
                "--initial-cluster", f"weightstream-test=http://{host}:{peer}",
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        with inside:
            _wait_for(f"{url}/health", process, log)
        yield url
    finally:
        stop(process)
