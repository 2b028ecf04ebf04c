"""A real etcd for the fleet tests: Debian's ``etcd-server`` (3.4), fetched with ``apt-get download`` (or found in
``.whl/``, where ``benchmarks/gpu_check.sh prepare`` puts it for a machine without a network) and unpacked into
``~/.cache/weightstream`` on first use, started on loopback ports of its own."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import ssl
import subprocess
import tempfile
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
        # Test workers start at once: each unpacks into a folder of its own and renames it into place, one wins.
        prefix.parent.mkdir(parents=True, exist_ok=True)
        with tempfile_directory() as scratch:
            carried = sorted(CARRIED.glob(f"{PACKAGE}_*.deb"))
            if not carried:
                download = ["apt-get", "download", PACKAGE]
                subprocess.run(download, cwd=scratch, check=True, capture_output=True, timeout=300)
            (package,) = carried or Path(scratch).glob(f"{PACKAGE}_*.deb")
            unpacked = Path(tempfile.mkdtemp(prefix=f".{PACKAGE}-", dir=prefix.parent))
            try:
                unpack = ["dpkg", "-x", str(package), str(unpacked)]
                subprocess.run(unpack, check=True, capture_output=True, timeout=300)
                with contextlib.suppress(OSError):  # another worker's is in place already
                    unpacked.rename(prefix)
            finally:
                shutil.rmtree(unpacked, ignore_errors=True)
    return str(binary)


@dataclasses.dataclass(frozen=True)
class Certificates:
    """A CA of a test's own, a certificate for etcd on 127.0.0.1 signed by it, and one for a fleet's node (PEM)."""

    ca: Path
    server: Path
    server_key: Path
    node: Path
    node_key: Path

    def context(self) -> ssl.SSLContext:
        """What a node of the fleet trusts and shows."""
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.node), str(self.node_key))
        return context


def certificates(directory: Path) -> Certificates:
    """Make a CA and etcd's and a node's certificates in ``directory`` (``openssl``; valid for a day)."""

    def openssl(*arguments: str) -> None:
        subprocess.run(["openssl", *arguments], cwd=directory, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=weightstream test CA", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    for name, usage in (("server", "serverAuth,clientAuth"), ("node", "clientAuth")):
        extensions = directory / f"{name}.ext"
        # etcd's JSON gateway reaches its own gRPC server with the server's certificate: it is a client too.
        extensions.write_text(
            f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\nkeyUsage=critical,digitalSignature,"
            "keyEncipherment\nauthorityKeyIdentifier=keyid\nbasicConstraints=CA:FALSE\n"
        )
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=weightstream test {name}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "1", "-extfile", str(extensions))  # fmt: skip
    return Certificates(*(directory / name for name in ("ca.pem", "server.pem", "server.key", "node.pem", "node.key")))


@contextlib.contextmanager
def etcd_server(
    directory: Path,
    network: Network | None = None,
    certificates: Certificates | None = None,
    client_port: int | None = None,
) -> Iterator[str]:
    """etcd with its data in ``directory``; yields its client URL (``http://127.0.0.1:PORT``, or on ``network``'s hub
    when one is given: ``http://10.213.0.1:2379``, reachable from its machines only). With ``certificates``:
    ``https://127.0.0.1:PORT``, answering only clients with a certificate its CA signed. ``client_port``: that port
    (an etcd started again where an earlier one was)."""
    if network is None:
        host, client, peer, wrap, inside = (
            "127.0.0.1",
            client_port or free_port(),
            free_port(),
            [],
            contextlib.nullcontext(),
        )
    else:
        host, client, peer, inside = HUB_ADDRESS, 2379, 2380, network.inside()
        wrap = ["ip", "netns", "exec", network.hub]
    url = f"{'http' if certificates is None else 'https'}://{host}:{client}"
    tls = []
    if certificates is not None:
        tls = ["--cert-file", str(certificates.server), "--key-file", str(certificates.server_key),
               "--trusted-ca-file", str(certificates.ca), "--client-cert-auth"]  # fmt: skip
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
                *tls,
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        with inside:
            _wait_for(f"{url}/health", process, log, context=certificates and certificates.context())
        yield url
    finally:
        stop(process)
