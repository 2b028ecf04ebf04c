"""az:// against a real Azure Blob emulator (Azurite): every way to give credentials, missing containers and
blobs, refusals before any request; blob SAS URLs read over http(s):// with their signatures redacted. Round
trips, blobs replaced mid-load and faults run for az:// with the other object stores (the ``scheme`` and
``faulty`` fixtures)."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import pytest

import weightstream
from tests.conftest import assert_same, save_hf_sharded
from tests.objstore import AZURE_ACCOUNT, AZURE_KEY, azure_connection_string, put
from tests.test_objectstore import upload
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.errors import InvalidOptionError

pytestmark = pytest.mark.slow

SHAPE = LlamaShape(hidden=64, intermediate=160, layers=2, vocab=96)


@pytest.fixture
def checkpoint(azure_endpoint, tmp_path: Path):
    state = llama_state_dict(SHAPE, seed=4)
    return upload("az", save_hf_sharded(state, tmp_path / "ckpt", shards=2), "credentials"), state


def container_sas(*, list_too: bool = True) -> str:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    now = datetime.datetime.now(datetime.timezone.utc)
    return generate_container_sas(
        AZURE_ACCOUNT,
        "bench",
        account_key=AZURE_KEY,
        permission=ContainerSasPermissions(read=True, list=list_too),
        start=now - datetime.timedelta(minutes=5),
        expiry=now + datetime.timedelta(hours=1),
    )


def endpoint_only(azure_endpoint: str) -> str:
    """A connection string that names the account and its endpoint, and holds no credential."""
    return f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};BlobEndpoint={azure_endpoint}/{AZURE_ACCOUNT};"


def test_a_connection_string_from_the_environment_or_the_options(azure_endpoint, checkpoint, monkeypatch, no_leaks):
    uri, state = checkpoint
    assert_same(weightstream.load_weights(uri), state)  # AZURE_STORAGE_CONNECTION_STRING, set by the fixture
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    options = {"connection_string": azure_connection_string(azure_endpoint)}
    assert_same(weightstream.load_weights(uri, storage_options=options), state)


@pytest.mark.parametrize("where", ["sas_token", "connection string"])
def test_a_sas_token_reads_without_the_account_key(azure_endpoint, checkpoint, monkeypatch, where, no_leaks):
    uri, state = checkpoint
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    sas = container_sas()
    if where == "sas_token":
        options = {"connection_string": endpoint_only(azure_endpoint), "sas_token": sas}
    else:
        options = {"connection_string": endpoint_only(azure_endpoint) + f"SharedAccessSignature={sas};"}
    assert_same(weightstream.load_weights(uri, storage_options=options, format="streaming"), state)


def test_the_standard_variables_name_the_account_and_its_key(azure_endpoint, checkpoint, monkeypatch, no_leaks):
    uri, state = checkpoint
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", endpoint_only(azure_endpoint))
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", AZURE_KEY)
    assert_same(weightstream.load_weights(uri, format="layered"), state)


def test_a_missing_container_or_blob_is_not_found(azure_endpoint, no_leaks):
    with pytest.raises(weightstream.NotFound, match=r"az://no-such-container/model: no such"):
        weightstream.load_weights("az://no-such-container/model")
    with pytest.raises(weightstream.NotFound, match=r"az://bench/no-such/model.safetensors: no such"):
        weightstream.load_weights("az://bench/no-such/model.safetensors")


def test_a_sas_that_may_not_list_is_refused_with_its_signature_redacted(azure_endpoint, checkpoint, monkeypatch):
    uri, _ = checkpoint
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    sas = container_sas(list_too=False)
    options = {"connection_string": endpoint_only(azure_endpoint), "sas_token": sas}
    with pytest.raises(weightstream.SourceError, match=r"access denied") as refused:
        weightstream.load_weights(uri, storage_options=options)
    signature = dict(part.split("=", 1) for part in sas.split("&"))["sig"]
    assert signature not in str(refused.value)


def test_missing_account_or_credentials_are_refused_before_any_request(monkeypatch):
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    for variable in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(InvalidOptionError, match=r"az://: no storage account: give storage_options account_name"):
        weightstream.load_weights("az://bench/model")
    with pytest.raises(InvalidOptionError, match=r"az:// on https://acct.blob.core.windows.net: no credentials"):
        weightstream.load_weights("az://bench/model", storage_options={"account_name": "acct"})
    with pytest.raises(InvalidOptionError, match=r"storage_options for az:// take account_name, .*; got endpoint_url"):
        weightstream.load_weights("az://bench/model", storage_options={"endpoint_url": "http://x"})
    with pytest.raises(InvalidOptionError, match=r"connection string's fields are Name=value; got 'AccountKey'"):
        weightstream.load_weights("az://bench/model", storage_options={"connection_string": "AccountKey"})


@pytest.mark.parametrize("where", ["options", "connection string", "environment"])
def test_an_account_key_that_is_not_base64_is_refused_in_one_line(monkeypatch, where):
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    options: dict[str, str] = {}
    if where == "options":
        options = {"account_name": "acct", "account_key": "not base64!"}
    elif where == "connection string":
        options = {"connection_string": "AccountName=acct;AccountKey=not-base64!;EndpointSuffix=core.windows.net"}
    else:
        monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
        monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "not base64!")
    with pytest.raises(
        InvalidOptionError,
        match=r"^az:// on https://acct\.blob\.core\.windows\.net: the account key is not base64 \(copy it whole",
    ):
        weightstream.load_weights("az://bench/model", storage_options=options)


def test_an_abfs_uri_with_its_account_reads_and_another_account_is_refused(azure_endpoint, checkpoint, no_leaks):
    uri, state = checkpoint
    path = uri.removeprefix("az://bench/")
    assert_same(weightstream.load_weights(f"abfs://bench@{AZURE_ACCOUNT}.dfs.core.windows.net/{path}"), state)
    with pytest.raises(InvalidOptionError, match=r"names account 'other', but the storage options are for"):
        weightstream.load_weights(f"abfs://bench@other.dfs.core.windows.net/{path}")


def blob_sas(container: str, blob: str, *, expiry_hours: float = 1.0) -> str:
    from azure.storage.blob import BlobSasPermissions, generate_blob_sas

    now = datetime.datetime.now(datetime.timezone.utc)
    return generate_blob_sas(
        AZURE_ACCOUNT,
        container,
        blob,
        account_key=AZURE_KEY,
        permission=BlobSasPermissions(read=True),
        start=now - datetime.timedelta(minutes=5),
        expiry=now + datetime.timedelta(hours=expiry_hours),
    )


def test_a_blob_sas_url_loads_as_a_file_and_a_bad_one_fails_without_its_signature(
    azure_endpoint, tmp_path: Path, caplog, no_leaks
):
    state = llama_state_dict(LlamaShape(hidden=64, intermediate=160, layers=1, vocab=96), seed=1)
    local = save_hf_sharded(state, tmp_path / "ckpt", shards=1)
    put("az", Path(local) / "model-00001-of-00001.safetensors", "sas/model.safetensors")
    sas = blob_sas("bench", "sas/model.safetensors")
    url = f"{azure_endpoint}/{AZURE_ACCOUNT}/bench/sas/model.safetensors?{sas}"
    loaded = weightstream.load_weights(url)
    assert loaded.keys() == state.keys()
    signature = dict(part.split("=", 1) for part in sas.split("&"))["sig"]
    other = "A" if signature[0] != "A" else "B"  # a first character that differs (a signature may start with "X")
    tampered = url.replace(f"sig={signature}", f"sig={other}{signature[1:]}")
    refusal = r"sig=REDACTED: access denied \(HTTP 403"
    with (
        caplog.at_level(logging.DEBUG, logger="weightstream"),
        pytest.raises(weightstream.SourceError, match=refusal) as refused,
    ):
        weightstream.load_weights(tampered)
    assert signature[1:] not in str(refused.value) and signature[1:] not in caplog.text
    expired = url.replace(sas, blob_sas("bench", "sas/model.safetensors", expiry_hours=-1))
    with pytest.raises(weightstream.SourceError, match=r"access denied") as refused:
        weightstream.load_weights(expired)
    assert "sig=REDACTED" in str(refused.value)


def test_a_public_container_reads_anonymously_and_a_private_one_refuses(azure_endpoint, tmp_path: Path, monkeypatch):
    from azure.storage.blob import BlobServiceClient

    state = llama_state_dict(SHAPE, seed=5)
    local = save_hf_sharded(state, tmp_path / "ckpt", shards=1)
    with BlobServiceClient.from_connection_string(azure_connection_string(azure_endpoint)) as service:
        if not service.get_container_client("public").exists():
            service.create_container("public", public_access="container")
        for path in Path(local).iterdir():
            with open(path, "rb") as body:
                service.get_blob_client("public", f"anonymous/{path.name}").upload_blob(body, overwrite=True)
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    options = {"connection_string": endpoint_only(azure_endpoint), "anon": True}
    assert_same(weightstream.load_weights("az://public/anonymous", storage_options=options), state)
    with pytest.raises(weightstream.SourceError, match=r"az://bench/credentials: access denied \(HTTP 403"):
        weightstream.load_weights("az://bench/credentials", storage_options=options)
