"""oci:// against a real registry (Debian's docker-registry, the CNCF distribution registry 2.8, started by the
test): artifacts pushed with ``weightstream push``, read by every loader, by tag and by digest; a tag moved
mid-load, a corrupted blob, tar layers (ModelKits), compressed layers, indexes, basic auth, faults."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import weightstream
from tests.cache_daemon import ROOT
from tests.conftest import assert_same, save_hf_sharded
from tests.faultproxy import FaultProxy
from tests.objstore import htpasswd, oci_registry
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.errors import FormatError, IntegrityError, UnsupportedInputError
from weightstream.save.push import push

pytestmark = pytest.mark.slow

SHAPE = LlamaShape(hidden=128, intermediate=352, layers=2, vocab=500)


@pytest.fixture(scope="module")
def registry_directory(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("registry")


@pytest.fixture(scope="module")
def registry(registry_directory):
    with oci_registry(registry_directory) as address:
        yield address


def pushed(registry: str, tmp_path: Path, name: str, seed: int = 1, shards: int = 2) -> tuple[str, dict]:
    state = llama_state_dict(SHAPE, seed=seed)
    uri = f"oci://{registry}/tests/{name}:v1"
    push(save_hf_sharded(state, tmp_path / f"ckpt-{seed}", shards=shards), uri)
    return uri, state


def manifest_of(registry: str, repository: str, tag: str) -> tuple[dict, str]:
    request = urllib.request.Request(
        f"http://{registry}/v2/{repository}/manifests/{tag}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        body = answer.read()
    return json.loads(body), "sha256:" + hashlib.sha256(body).hexdigest()


def put_manifest(registry: str, repository: str, tag: str, manifest: dict, media_type: str) -> None:
    body = json.dumps(manifest).encode()
    request = urllib.request.Request(
        f"http://{registry}/v2/{repository}/manifests/{tag}", data=body, method="PUT",
        headers={"Content-Type": media_type},
    )  # fmt: skip
    urllib.request.urlopen(request, timeout=10).read()


def put_blob(registry: str, repository: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    start = urllib.request.Request(f"http://{registry}/v2/{repository}/blobs/uploads/", data=b"", method="POST")
    with urllib.request.urlopen(start, timeout=10) as answer:
        location = answer.headers["Location"]
    location = location if location.startswith("http") else f"http://{registry}{location}"
    finish = urllib.request.Request(
        f"{location}{'&' if '?' in location else '?'}digest={digest}", data=data, method="PUT",
        headers={"Content-Type": "application/octet-stream"},
    )  # fmt: skip
    urllib.request.urlopen(finish, timeout=10).read()
    return digest


@pytest.mark.parametrize("format", ["auto", "safetensors", "streaming", "layered"])
def test_an_artifact_pushed_is_read_bit_exact_by_every_loader(registry, tmp_path: Path, format, no_leaks):
    uri, state = pushed(registry, tmp_path, f"every-loader-{format}")
    assert_same(weightstream.load_weights(uri, format=format, chunk_bytes=65536), state)
    manifest, digest = manifest_of(registry, f"tests/every-loader-{format}", "v1")
    assert manifest["artifactType"] == "application/vnd.cncf.model.manifest.v1+json"
    assert {layer["mediaType"] for layer in manifest["layers"]} == {
        "application/vnd.cncf.model.weight.v1.raw",
        "application/vnd.cncf.model.weight.config.v1.raw",
    }
    by_digest = f"oci://{registry}/tests/every-loader-{format}@{digest}"
    assert_same(weightstream.load_weights(by_digest, format=format), state)


def test_pushing_again_sends_no_blob_the_registry_holds(registry, tmp_path: Path):
    state = llama_state_dict(SHAPE, seed=2)
    local = save_hf_sharded(state, tmp_path / "ckpt", shards=2)
    first = push(local, f"oci://{registry}/tests/again:v1")
    second = push(local, f"oci://{registry}/tests/again:v2")
    assert first["bytes_sent"] == first["bytes"] > 0 and second["bytes_sent"] == 0
    assert first["digest"] != second["digest"], "the config names the version"


def test_a_tag_moved_mid_load_still_reads_the_artifact_it_named(registry, tmp_path: Path, no_leaks):
    uri, state = pushed(registry, tmp_path, "moved", seed=1)
    other = save_hf_sharded(llama_state_dict(SHAPE, seed=9), tmp_path / "other", shards=2)
    moved, once = [], threading.Lock()

    def move_the_tag(nbytes: int) -> None:  # called by every reader thread: the first one pushes
        with once:
            if not moved:
                moved.append(push(other, uri))

    assert_same(weightstream.load_weights(uri, format="streaming", chunk_bytes=65536, progress=move_the_tag), state)
    assert moved, "the tag moved during the load"
    assert not weightstream.load_weights(uri)["lm_head.weight"].equal(state["lm_head.weight"]), (
        "a new load: the new tag"
    )


def test_a_corrupted_blob_is_an_integrity_error_naming_blob_and_file(
    registry, registry_directory, tmp_path: Path, no_leaks
):
    uri, _ = pushed(registry, tmp_path, "corrupted", shards=1)
    manifest, _ = manifest_of(registry, "tests/corrupted", "v1")
    weights = next(layer for layer in manifest["layers"] if layer["annotations"]["org.cncf.model.filepath"].endswith(
        ".safetensors"))  # fmt: skip
    hex_digest = weights["digest"].split(":", 1)[1]
    stored = registry_directory / "data/docker/registry/v2/blobs/sha256" / hex_digest[:2] / hex_digest / "data"
    flipped = bytearray(stored.read_bytes())
    flipped[-1] ^= 0xFF  # the registry's own file: it serves what it stores
    stored.write_bytes(bytes(flipped))
    with pytest.raises(IntegrityError, match=rf"model-00001-of-00001.safetensors: blob {weights['digest']} hashes to"):
        weightstream.load_weights(uri)


def test_a_tar_layer_is_read_in_place(registry, tmp_path: Path, no_leaks):
    state = llama_state_dict(SHAPE, seed=3)
    local = Path(save_hf_sharded(state, tmp_path / "ckpt", shards=2))
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for path in sorted(local.iterdir()):
            archive.add(path, arcname=f"weights/{path.name}")
    layer = stream.getvalue()
    config = b"{}"
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.kitops.modelkit.config.v1+json", "digest": put_blob(
            registry, "tests/modelkit", config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.kitops.modelkit.model.v1.tar", "digest": put_blob(
            registry, "tests/modelkit", layer), "size": len(layer)}],
    }  # fmt: skip
    put_manifest(registry, "tests/modelkit", "v1", manifest, manifest["mediaType"])
    uri = f"oci://{registry}/tests/modelkit:v1"
    with weightstream.open(uri + "/weights", filter=()) as planned:
        assert planned.plan.files  # the directory inside the layer
    assert_same(weightstream.load_weights(uri + "/weights"), state)


def push_tar_layer(registry: str, repository: str, layer: bytes) -> str:
    """A ModelKit-style artifact of one uncompressed tar layer; its URI."""
    config = b"{}"
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.kitops.modelkit.config.v1+json", "digest": put_blob(
            registry, repository, config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.kitops.modelkit.model.v1.tar", "digest": put_blob(
            registry, repository, layer), "size": len(layer)}],
    }  # fmt: skip
    put_manifest(registry, repository, "v1", manifest, manifest["mediaType"])
    return f"oci://{registry}/{repository}:v1"


def member_sized_by_pax(name: str, data: bytes, size_record: str) -> bytes:
    """A tar member whose size is in its PAX record alone (its ustar field says 0), as writers store members of
    8 GiB and more."""
    info = tarfile.TarInfo(name)
    info.size = 0
    info.pax_headers = {"size": size_record}
    header = info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
    return header + data + bytes(-len(data) % tarfile.BLOCKSIZE)


def test_a_member_sized_by_its_pax_record_is_read(registry, tmp_path: Path, no_leaks):
    state = llama_state_dict(SHAPE, seed=5)
    local = Path(save_hf_sharded(state, tmp_path / "ckpt", shards=1))
    layer = b"".join(
        member_sized_by_pax(f"weights/{path.name}", path.read_bytes(), str(path.stat().st_size))
        for path in sorted(local.iterdir())
    )
    uri = push_tar_layer(registry, "tests/pax-sized", layer + bytes(2 * tarfile.BLOCKSIZE))
    assert_same(weightstream.load_weights(uri + "/weights"), state)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ("12x", r"a PAX size record is '12x', not a size in bytes"),
        ("-5", r"a PAX size record is '-5', not a size in bytes"),
        ("9" * 30, r"a PAX size record is '9{30}', not a size in bytes"),
        ("999999", r"member 'weights/model.safetensors' at byte 1024 runs past the layer's end"),
    ],
)
def test_a_bad_pax_size_is_refused_at_plan(registry, record, message, no_leaks):
    layer = member_sized_by_pax("weights/model.safetensors", b"abcd", record) + bytes(2 * tarfile.BLOCKSIZE)
    uri = push_tar_layer(registry, f"tests/bad-pax-{len(record)}-{record[:2].strip('-')}", layer)
    with pytest.raises(FormatError, match=message):
        weightstream.open(uri + "/weights", filter=()).close()


def test_a_compressed_layer_is_refused_naming_its_media_type(registry, no_leaks):
    data = b"\x1f\x8b" + bytes(30)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.cncf.model.config.v1+json", "digest": put_blob(
            registry, "tests/gzipped", b"{}"), "size": 2},
        "layers": [{"mediaType": "application/vnd.cncf.model.weight.v1.tar+gzip", "digest": put_blob(
            registry, "tests/gzipped", data), "size": len(data)}],
    }  # fmt: skip
    put_manifest(registry, "tests/gzipped", "v1", manifest, manifest["mediaType"])
    with pytest.raises(UnsupportedInputError, match=r"is application/vnd.cncf.model.weight.v1.tar\+gzip: a compressed"):
        weightstream.load_weights(f"oci://{registry}/tests/gzipped:v1")


def test_an_index_is_resolved_to_its_manifest(registry, tmp_path: Path, no_leaks):
    _, state = pushed(registry, tmp_path, "indexed")
    _, digest = manifest_of(registry, "tests/indexed", "v1")
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest, "size": 1}],
    }
    put_manifest(registry, "tests/indexed", "index", index, index["mediaType"])
    assert_same(weightstream.load_weights(f"oci://{registry}/tests/indexed:index"), state)


def test_missing_tags_repositories_and_files_are_not_found(registry, tmp_path: Path, no_leaks):
    uri, _ = pushed(registry, tmp_path, "present")
    with pytest.raises(weightstream.NotFound, match=r"tests/present:nope \(manifest nope\): no such manifest"):
        weightstream.load_weights(f"oci://{registry}/tests/present:nope")
    with pytest.raises(weightstream.NotFound, match=r"no such manifest"):
        weightstream.load_weights(f"oci://{registry}/tests/absent:v1")
    with pytest.raises(weightstream.NotFound, match=r"present:v1/nothing.safetensors: no such file or directory"):
        weightstream.load_weights(f"{uri}/nothing.safetensors")


@pytest.mark.parametrize(
    "uri, message",
    [
        ("oci://registry.io/model", r"name the artifact's version"),
        ("oci://registry.io/Model:v1", r"'Model' is not a valid repository name"),
        ("oci://registry.io/m@sha256:abc", r"a digest is sha256: and 64 lowercase hex digits"),
        ("oci://registry.io/m:v1/../../etc/passwd", r"the path '../../etc/passwd' leaves the artifact"),
    ],
)
def test_malformed_references_are_refused_before_any_request(uri, message):
    with pytest.raises(weightstream.WeightstreamError, match=message):
        weightstream.load_weights(uri)


def test_basic_auth_from_options_or_the_docker_config(tmp_path: Path, monkeypatch, no_leaks):
    directory = tmp_path / "private"
    directory.mkdir()
    with oci_registry(directory, htpasswd(directory / "htpasswd", "reader", "s3cret")) as address:
        options = {"username": "reader", "password": "s3cret"}
        state = llama_state_dict(SHAPE, seed=6)
        uri = f"oci://{address}/private/model:v1"
        push(save_hf_sharded(state, tmp_path / "ckpt", shards=1), uri, options)
        assert_same(weightstream.load_weights(uri, storage_options=options), state)
        with pytest.raises(weightstream.AccessDeniedError, match=r"access denied \(HTTP 401\)"):
            weightstream.load_weights(uri, storage_options={"username": "reader", "password": "wrong"})
        config = tmp_path / "docker"
        config.mkdir()
        (config / "config.json").write_text(json.dumps({"auths": {address: {"auth": "cmVhZGVyOnMzY3JldA=="}}}))
        monkeypatch.setenv("DOCKER_CONFIG", str(config))
        assert_same(weightstream.load_weights(uri), state)


def test_faults_on_blob_reads_are_retried_and_resumed(registry, tmp_path: Path, no_leaks):
    uri, state = pushed(registry, tmp_path, "faulty")
    with FaultProxy(int(registry.split(":")[1])) as proxy:
        through = uri.replace(registry, proxy.url.split("//")[1])
        stream = weightstream.iter_weights(through, chunk_bytes=65536, threads=2)
        proxy.inject(r"^GET /v2/tests/faulty/blobs/", "503", times=3)
        proxy.inject(r"^GET /v2/tests/faulty/blobs/", "reset", times=2, after_bytes=20_000, min_range_bytes=60_000)
        assert_same(dict(stream), state)


def test_the_cli_pushes_and_loads(registry, tmp_path: Path):
    local = save_hf_sharded(llama_state_dict(SHAPE, seed=7), tmp_path / "ckpt", shards=1)
    uri = f"oci://{registry}/tests/cli:v1"
    command = [sys.executable, "-m", "weightstream.cli"]
    pushed_run = subprocess.run(
        [*command, "push", local, uri, "--json"], check=False, cwd=ROOT, capture_output=True, text=True
    )
    assert pushed_run.returncode == 0, pushed_run.stderr
    result = json.loads(pushed_run.stdout)
    assert result["files"] == 2 and result["digest"].startswith("sha256:")
    loaded = subprocess.run([*command, "load", uri, "--json"], check=False, cwd=ROOT, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout)["tensors"] == len(llama_state_dict(SHAPE, seed=7))


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory):
    """A registry that takes bearer tokens from the tests' own token server: (address, token server)."""
    from tests.registry_tokens import TokenServer

    directory = tmp_path_factory.mktemp("token-registry")
    with TokenServer(directory) as tokens, oci_registry(directory, tokens.auth_yaml) as address:
        yield address, tokens


def test_the_bearer_token_flow_with_credentials(token_registry, tmp_path: Path, no_leaks):
    address, tokens = token_registry
    tokens.users = {"puller": "pa55"}
    options = {"username": "puller", "password": "pa55"}
    try:
        uri = f"oci://{address}/tokens/model:v1"
        state = llama_state_dict(SHAPE, seed=8)
        push(save_hf_sharded(state, tmp_path / "ckpt", shards=2), uri, options)
        before = tokens.issued
        assert_same(weightstream.load_weights(uri, storage_options=options), state)
        assert tokens.issued - before == 1, "one token serves the whole load"
        with pytest.raises(weightstream.AccessDeniedError, match=r"the token service at .* answered HTTP 401"):
            weightstream.load_weights(uri, storage_options={"username": "puller", "password": "wrong"})
    finally:
        tokens.users = {}


def test_a_token_that_expires_mid_load_is_renewed_and_the_range_retried(token_registry, tmp_path: Path, no_leaks):
    address, tokens = token_registry
    uri = f"oci://{address}/tokens/expiring:v1"
    state = llama_state_dict(SHAPE, seed=10)
    push(save_hf_sharded(state, tmp_path / "ckpt", shards=2), uri)
    tokens.valid_for_s = 4.0  # the first token of the load lives 4 s, leeway included
    slept = []

    def outlive_the_token(nbytes: int) -> None:
        if not slept:
            slept.append(nbytes)
            tokens.valid_for_s = 300.0
            time.sleep(5)

    try:
        before = tokens.issued
        loaded = weightstream.load_weights(
            uri, format="streaming", chunk_bytes=65536, threads=1, progress=outlive_the_token
        )
        assert_same(loaded, state)
        assert tokens.issued - before == 2, "the expired token was replaced once"
    finally:
        tokens.valid_for_s = 300.0


@pytest.mark.timeout(120)
def test_blobs_redirected_to_object_storage_are_read_there_without_the_registrys_credentials(
    s3_endpoint, tmp_path: Path, no_leaks
):
    from weightstream.sources.oci.store import OciStore

    directory = tmp_path / "s3-registry"
    directory.mkdir()
    auth = htpasswd(directory / "htpasswd", "reader", "s3cret")
    with oci_registry(directory, auth, s3_endpoint) as address, FaultProxy(int(address.split(":")[1])) as watched:
        options = {"username": "reader", "password": "s3cret"}
        state = llama_state_dict(SHAPE, seed=11)
        push(save_hf_sharded(state, tmp_path / "ckpt", shards=2), f"oci://{address}/redirected/model:v1", options)
        uri = f"oci://{watched.url.split('//')[1]}/redirected/model:v1"
        assert_same(weightstream.load_weights(uri, storage_options=options, chunk_bytes=65536), state)
        blob_gets = [ranges for line, ranges in watched.requests if line.startswith("GET /v2/redirected/model/blobs/")]
        assert blob_gets and set(blob_gets) == {"bytes=0-0"}, "the registry only redirected; the bytes came from S3"
        store = OciStore(options)
        try:
            source = store.open(uri + "/model-00001-of-00002.safetensors")
            target = store.range_target(source)
            assert target.url.startswith(s3_endpoint) and "X-Amz-Signature=" in target.url
            assert "Authorization" not in target.headers
        finally:
            store.close()


def test_an_expired_redirect_is_asked_for_again_and_the_range_resumes(tmp_path: Path, no_leaks):
    from tests.rangeserver import RangeServer

    directory = tmp_path / "redirecting-registry"
    directory.mkdir()
    # The registry's redirect middleware sends blob reads to a server of the test's own over its storage: the
    # stand-in for presigned object-storage URLs, which can be made to answer 403 as an expired one does.
    with RangeServer(directory / "data") as storage:
        middleware = f"middleware:\n  storage:\n    - name: redirect\n      options:\n        baseurl: {storage.url}/\n"
        with oci_registry(directory, middleware) as address:
            state = llama_state_dict(SHAPE, seed=13)
            uri = f"oci://{address}/expiring/model:v1"
            push(save_hf_sharded(state, tmp_path / "ckpt", shards=1), uri)
            stream = weightstream.iter_weights(uri, chunk_bytes=65536, threads=1)
            before = len(storage.requests)
            storage.misbehave.forbid_next = 1
            assert_same(dict(stream), state)
    blob_reads = [line for line in storage.requests[before:] if line.startswith("GET /docker/registry/v2/blobs/")]
    assert len(blob_reads) > 3 and storage.misbehave.forbid_next == 0, "the expired URL was met, then replaced"


def corrupt_blob(registry_directory: Path, digest: str, at: int = -1) -> None:
    """Flip a byte of the registry's own copy of blob ``digest``: it serves what it stores, under that digest."""
    hex_digest = digest.split(":", 1)[1]
    stored = registry_directory / "data/docker/registry/v2/blobs/sha256" / hex_digest[:2] / hex_digest / "data"
    flipped = bytearray(stored.read_bytes())
    flipped[at] ^= 0xFF
    stored.write_bytes(bytes(flipped))


def test_a_corrupted_blob_is_never_published_by_the_cache_however_often_it_is_asked(
    registry, registry_directory, tmp_path: Path, no_leaks
):
    from tests.cache_daemon import request, running_daemon

    uri, _ = pushed(registry, tmp_path, "corrupted-cached", seed=11, shards=1)  # a blob of its own
    manifest, _ = manifest_of(registry, "tests/corrupted-cached", "v1")
    weights = next(layer for layer in manifest["layers"] if layer["annotations"]["org.cncf.model.filepath"].endswith(
        ".safetensors"))  # fmt: skip
    corrupt_blob(registry_directory, weights["digest"])
    with running_daemon("oci") as daemon:
        for _ in range(3):  # the first fill fails; no later one may skip the check the first one finished
            with pytest.raises(IntegrityError, match=rf"blob {weights['digest']} hashes to"):
                weightstream.load_weights(uri, cache=str(daemon.socket))
        entries = request(daemon.socket, {"op": "ls"})["entries"]
        stats = request(daemon.socket, {"op": "stats"})
    assert not [entry for entry in entries if entry["uri"].endswith(".safetensors")], entries
    assert stats["fill_errors"] == 3


def tar_artifact_with_a_tokenizer(registry: str, tmp_path: Path, repository: str) -> tuple[str, dict, str, int]:
    """A tar layer holding the weights and a 5 MiB tokenizer after them: (uri, state, layer digest, weights' end)."""
    state = llama_state_dict(SHAPE, seed=6)
    local = Path(save_hf_sharded(state, tmp_path / "ckpt", shards=1))
    (local / "tokenizer.json").write_bytes(os.urandom(5 << 20))
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name in ("model.safetensors.index.json", "model-00001-of-00001.safetensors", "tokenizer.json"):
            if (local / name).exists():
                archive.add(local / name, arcname=f"weights/{name}")
    layer = stream.getvalue()
    uri = push_tar_layer(registry, repository, layer)
    weights = (local / "model-00001-of-00001.safetensors").read_bytes()
    last_weight_byte = layer.index(weights) + len(weights) - 1
    return uri, state, "sha256:" + hashlib.sha256(layer).hexdigest(), last_weight_byte


def test_weights_in_a_tar_layer_with_a_large_tokenizer_are_checked_by_the_cache_and_warned_of_directly(
    registry, registry_directory, tmp_path: Path, caplog, no_leaks
):
    from tests.cache_daemon import running_daemon

    uri, state, digest, last_weight_byte = tar_artifact_with_a_tokenizer(registry, tmp_path, "tests/tokenizer-after")
    corrupt_blob(registry_directory, digest, at=last_weight_byte)  # a weight's byte; the tokenizer is after it
    with caplog.at_level("WARNING", logger="weightstream"):
        loaded = weightstream.load_weights(uri + "/weights")  # reads the weights, not the tokenizer: unchecked
    assert not all(torch.equal(loaded[name], state[name]) for name in state)
    warned = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert any(f"blob {digest} NOT checked against its digest" in message for message in warned), warned
    with running_daemon("oci-tar") as daemon:
        for _ in range(2):
            with pytest.raises(IntegrityError, match=rf"blob {digest} hashes to"):
                weightstream.load_weights(uri + "/weights", cache=str(daemon.socket))
