"""Hugging Face model ids (``hf://org/name[@revision][/path]``): read from an offline cache laid out as
``huggingface_hub`` writes it, or from a real local Hub (tests/hub.py) whose files redirect to a CDN on
another loopback host; pinned to one commit; the token kept to the Hub; typed errors for each miss."""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import weightstream
from tests.conftest import assert_same, save_hf_sharded
from tests.hub import HubServer, cache_model, commit_of
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.sources.hub.api import HubSettings
from weightstream.sources.hub.ids import HubReference, hub_uri, looks_like_repo_id, parse_hub_uri
from weightstream.sources.hub.store import pin

SHAPE = LlamaShape(hidden=64, intermediate=160, layers=2, vocab=256)
NO_HUB = "http://127.0.0.1:9"
"""An endpoint nothing answers on: a test that must make no request fails loudly if it does."""


@pytest.fixture
def hub_environment(tmp_path: Path, monkeypatch) -> Path:
    """A fresh cache directory as ``HF_HUB_CACHE``, no token anywhere, online, the Hub unreachable."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HOME", "HF_TOKEN_PATH", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_ENDPOINT", NO_HUB)
    return cache


@pytest.fixture
def sharded(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A two-shard checkpoint with its index and a config.json."""
    state = llama_state_dict(SHAPE, seed=5)
    directory = save_hf_sharded(state, tmp_path / "model", shards=2)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    return directory, state


def single_file(directory: Path, seed: int) -> tuple[Path, dict[str, torch.Tensor]]:
    from safetensors.torch import save_file

    state = llama_state_dict(SHAPE, seed=seed)
    directory.mkdir(parents=True)
    save_file(state, str(directory / "model.safetensors"))
    return directory, state


# The URI


REPO_PARTS = st.from_regex(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,20}[A-Za-z0-9])?", fullmatch=True).filter(
    lambda part: "--" not in part and ".." not in part
)
REVISIONS = st.one_of(
    st.just("main"),
    st.from_regex(r"[a-f0-9]{40}", fullmatch=True),
    st.lists(
        st.from_regex(r"[A-Za-z0-9_+-][A-Za-z0-9._+-]{0,10}", fullmatch=True).filter(
            lambda part: part not in (".", "..")
        ),
        min_size=1,
        max_size=3,
    ).map("/".join),
)
PATHS = st.lists(
    st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,12}", fullmatch=True).filter(lambda part: part not in (".", "..")),
    max_size=3,
).map("/".join)


@settings(max_examples=300, deadline=None)
@given(org=REPO_PARTS, name=REPO_PARTS, revision=REVISIONS, path=PATHS)
def test_every_well_formed_reference_survives_its_uri(org, name, revision, path):
    reference = HubReference(f"{org}/{name}", revision, path)
    assert parse_hub_uri(reference.uri) == reference
    assert parse_hub_uri(reference.uri.replace("hf://", "hf://models/", 1)) == reference


@settings(max_examples=500, deadline=None)
@given(rest=st.text(alphabet=st.characters(codec="utf-8"), max_size=60))
def test_any_text_is_a_reference_or_a_typed_refusal(rest):
    try:
        reference = parse_hub_uri("hf://" + rest)
    except weightstream.UnsupportedInputError as error:
        assert str(error).startswith("hf://")
    else:
        assert looks_like_repo_id(reference.repo_id) and ".." not in reference.path.split("/")


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("hf://datasets/org/data", r"only model repositories hold checkpoints here, not datasets"),
        ("hf://org/name/../other", r"'\.\./other' is not a path inside the repository"),
        ("hf://org/na--me", r"'org/na--me' is not a model id"),
        ("hf://org/name@", r"'' is not a revision"),
        ("hf://org/name@a%2F..%2Fb", r"'a/\.\./b' is not a revision"),
        ("hf://org/name?revision=main", r"has no query or fragment; name a revision with @revision"),
        ("hf://", r"'' is not a model id"),
    ],
)
def test_malformed_uris_are_refused_before_any_io(uri, message, hub_environment):
    with pytest.raises(weightstream.UnsupportedInputError, match=message):
        weightstream.load_weights(uri)


def test_settings_come_from_the_options_over_the_environment(tmp_path: Path):
    environ = {"HF_HOME": str(tmp_path), "HF_ENDPOINT": "https://mirror.example/", "HF_HUB_OFFLINE": "yes"}
    (tmp_path / "token").write_text("hf_saved\n")
    from_environment = HubSettings.from_options(None, environ)
    assert (
        from_environment.cache_dir,
        from_environment.endpoint,
        from_environment.offline,
        from_environment.token,
    ) == (str(tmp_path / "hub"), "https://mirror.example", True, "hf_saved")
    assert "hf_saved" not in repr(from_environment), "the token is never shown"
    chosen = HubSettings.from_options(
        {"cache_dir": "/c", "offline": False, "token": "hf_given"}, {**environ, "HF_TOKEN": "hf_env"}
    )
    assert (chosen.cache_dir, chosen.offline, chosen.token) == ("/c", False, "hf_given")
    assert chosen.request_headers() == {"Authorization": "Bearer hf_given"}
    with pytest.raises(
        weightstream.InvalidOptionError,
        match=r"storage_options for hf:// take cache_dir, endpoint, headers, offline, token; got revision",
    ):
        HubSettings.from_options({"revision": "main"}, {})
    with pytest.raises(
        weightstream.OptionError, match=r"storage_options\['offline'\] for hf:// must be True or False, got str"
    ):
        HubSettings.from_options({"offline": "1"}, {})


# The offline cache


def test_a_cached_checkpoint_is_read_from_the_cache_and_the_hub_is_never_asked(hub_environment, sharded, no_leaks):
    directory, state = sharded
    commit = cache_model(hub_environment, "org/tiny", directory)
    with weightstream.open("hf://org/tiny") as checkpoint:
        assert checkpoint.format == "safetensors"
        assert checkpoint.uri == str(hub_environment / "models--org--tiny" / "snapshots" / commit)
        assert_same(checkpoint.load(), state)
    for uri in (f"hf://org/tiny@{commit}", "hf://models/org/tiny@main/"):
        assert_same(weightstream.load_weights(uri), state)
    assert_same(dict(weightstream.iter_weights("hf://org/tiny", format="streaming")), state)


def test_resolve_model_names_the_snapshot_of_an_id_and_leaves_paths_as_they_are(hub_environment, sharded, tmp_path):
    directory, _ = sharded
    commit = cache_model(hub_environment, "org/tiny", directory)
    snapshot = str(hub_environment / "models--org--tiny" / "snapshots" / commit)
    assert weightstream.resolve_model("org/tiny") == snapshot
    assert weightstream.resolve_model("hf://org/tiny") == snapshot
    assert weightstream.resolve_model("org/tiny", "main", {"cache_dir": str(hub_environment)}) == snapshot
    assert weightstream.resolve_model(str(directory)) == str(directory)
    assert weightstream.resolve_model("s3://bucket/org/tiny") == "s3://bucket/org/tiny"
    with pytest.raises(weightstream.UnsupportedInputError, match=r"'\.\./x' is not a revision"):
        weightstream.resolve_model("org/tiny", "../x")


def test_revisions_and_paths_inside_the_repository(hub_environment, sharded, tmp_path: Path):
    directory, state = sharded
    cache_model(hub_environment, "org/tiny", directory)
    other, other_state = single_file(tmp_path / "v2" / "fp32", seed=6)
    tag = cache_model(hub_environment, "org/tiny", other.parent, revision="refs/pr/1")
    assert_same(weightstream.load_weights("hf://org/tiny@refs%2Fpr%2F1/fp32"), other_state)
    assert_same(weightstream.load_weights("hf://org/tiny@refs%2Fpr%2F1/fp32/model.safetensors"), other_state)
    assert_same(weightstream.load_weights(f"hf://org/tiny@{tag}/fp32"), other_state)
    assert_same(weightstream.load_weights("hf://org/tiny"), state)


def test_offline_a_miss_is_a_typed_error_naming_the_cache_and_no_request_is_made(
    hub_environment, monkeypatch, sharded, no_leaks
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        weightstream.NotFound,
        match=(
            rf"hf://org/absent: not in the Hugging Face cache at {hub_environment} \(no "
            rf"{hub_environment}/models--org--absent/refs/main\), "
            r"and HF_HUB_OFFLINE is set, so the Hub is not asked: download it first \(huggingface-cli download "
            r"org/absent --revision main\)"
        ),
    ):
        weightstream.load_weights("hf://org/absent")
    directory, _ = sharded
    commit = cache_model(hub_environment, "org/partial", directory, skip=("model-00002-of-00002.safetensors",))
    with pytest.raises(
        weightstream.NotFound,
        match=rf"snapshots/{commit} lacks 1 of the 2 shards its index names \(model-00002-of-00002\.safetensors\)",
    ):
        weightstream.load_weights("hf://org/partial")
    with pytest.raises(
        weightstream.NotFound, match=r"@v9: not in the Hugging Face cache .*refs/v9\), and offline=True"
    ):
        weightstream.load_weights("hf://org/partial@v9", storage_options={"offline": True})


def test_a_ref_that_is_not_a_commit_is_a_miss(hub_environment, sharded, monkeypatch):
    directory, _ = sharded
    cache_model(hub_environment, "org/tiny", directory)
    (hub_environment / "models--org--tiny" / "refs" / "main").write_text("not a commit")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(weightstream.NotFound, match=r"refs/main holds 'not a commit', not a commit hash"):
        weightstream.load_weights("hf://org/tiny")


# The Hub


def test_a_miss_is_read_from_the_hub_at_one_commit_and_the_token_never_reaches_the_cdn(
    hub_environment, monkeypatch, sharded, tmp_path, no_leaks
):
    directory, state = sharded
    with HubServer(tmp_path / "hub", token="hf_secret") as server:
        commit = server.publish("org/tiny", directory)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        with weightstream.open("hf://org/tiny") as checkpoint:
            assert checkpoint.format == "streaming"
            assert checkpoint.uri == f"{server.endpoint}/org/tiny/resolve/{commit}"
            assert_same(checkpoint.load(), state)
        assert server.requests[0] == "GET /api/models/org/tiny/revision/main"
        assert set(server.authorizations) == {"Bearer hf_secret"}
        assert server.cdn.authorizations and set(server.cdn.authorizations) == {None}, "the token went to the CDN"
        assert any(
            line.startswith(f"GET /org/tiny/{commit}/model-00001-of-00002.safetensors bytes=")
            for line in server.cdn.requests
        )


def test_a_partial_cache_goes_to_the_hub_and_a_single_file_repository_needs_no_index(
    hub_environment, monkeypatch, sharded, tmp_path, no_leaks
):
    directory, state = sharded
    cache_model(hub_environment, "org/tiny", directory, skip=("model-00001-of-00002.safetensors",))
    lone, lone_state = single_file(tmp_path / "lone", seed=7)
    with HubServer(tmp_path / "hub") as server:
        server.publish("org/tiny", directory)
        server.publish("org/lone", lone)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        assert_same(weightstream.load_weights("hf://org/tiny"), state)
        assert_same(weightstream.load_weights("hf://org/lone", format="layered"), lone_state)
        assert_same(weightstream.load_weights("hf://org/lone/model.safetensors"), lone_state)


def test_a_pinned_id_reads_its_commit_after_the_branch_moves(hub_environment, monkeypatch, tmp_path, no_leaks):
    first, first_state = single_file(tmp_path / "first", seed=8)
    second, second_state = single_file(tmp_path / "second", seed=9)
    with HubServer(tmp_path / "hub") as server:
        commit = server.publish("org/moving", first)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        pinned = pin("hf://org/moving")
        assert pinned == f"hf://org/moving@{commit}"
        server.publish("org/moving", second)
        assert_same(weightstream.load_weights(pinned), first_state)
        assert_same(weightstream.load_weights("hf://org/moving"), second_state)


def test_hub_refusals_are_typed_and_say_what_to_do(hub_environment, monkeypatch, sharded, tmp_path, no_leaks):
    directory, _ = sharded
    with HubServer(tmp_path / "hub", token="hf_secret") as server:
        server.publish("org/private", directory)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        with pytest.raises(
            weightstream.NotFound,
            match=r"HTTP 401 RepoNotFound: no such model repository, or it is private or gated \(set HF_TOKEN",
        ):
            weightstream.load_weights("hf://org/private")
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        with pytest.raises(
            weightstream.NotFound,
            match=r"hf://org/private@v2 \(.*/api/models/org/private/revision/v2\): the repository has no revision 'v2'",
        ):
            weightstream.load_weights("hf://org/private@v2")
        with pytest.raises(weightstream.NotFound, match=r"the repository has no 'fp8' at commit"):
            weightstream.load_weights("hf://org/private/fp8")
        with pytest.raises(weightstream.NotFound, match=r"the token was refused or does not grant it"):
            weightstream.load_weights("hf://org/private", storage_options={"token": "hf_wrong"})
        server.gated = True
        with pytest.raises(
            weightstream.SourceError,
            match=r"HTTP 403 GatedRepo: access to this repository is not granted to this token",
        ):
            weightstream.load_weights("hf://org/private")


def test_the_token_file_of_huggingface_cli_login_is_used(hub_environment, monkeypatch, tmp_path, no_leaks):
    lone, state = single_file(tmp_path / "lone", seed=10)
    (tmp_path / "hf-home").mkdir()
    (tmp_path / "hf-home" / "token").write_text("hf_saved")
    with HubServer(tmp_path / "hub", token="hf_saved") as server:
        server.publish("org/lone", lone)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        assert_same(weightstream.load_weights("hf://org/lone"), state)


def test_hub_ids_of_engines_resolve_as_the_engines_do(hub_environment, sharded, monkeypatch, tmp_path):
    from weightstream.engines.common import model_weights

    directory, _ = sharded
    commit = cache_model(hub_environment, "org/tiny", directory)
    snapshot = str(hub_environment / "models--org--tiny" / "snapshots" / commit)
    assert model_weights("org/tiny", None, None, {}) == (snapshot, {})
    assert model_weights(str(directory), None, None, {}) == (str(directory), {})
    assert model_weights("s3://bucket/llama", None, None, {"threads": 2}) == ("s3://bucket/llama", {"threads": 2})
    elsewhere = tmp_path / "download-dir"
    other = cache_model(elsewhere, "org/tiny", directory, revision="v1", commit=commit_of("v1"))
    assert model_weights("org/tiny", "v1", str(elsewhere), {}) == (
        str(elsewhere / "models--org--tiny" / "snapshots" / other),
        {"storage_options": {"cache_dir": str(elsewhere)}},
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(weightstream.NotFound, match=r"hf://org/tiny@v2: not in the Hugging Face cache"):
        model_weights("org/tiny", "v2", None, {})
    assert urllib.parse.unquote(hub_uri("org/tiny", "refs/pr/3")) == "hf://org/tiny@refs/pr/3"
    assert os.path.isdir(snapshot)


def test_a_private_repository_reads_through_the_cache_with_the_callers_token_sent_to_the_hub_only(
    hub_environment, monkeypatch, sharded, tmp_path, no_leaks
):
    from tests.cache_daemon import running_daemon

    directory, state = sharded
    with HubServer(tmp_path / "hub", token="hf_secret") as server, running_daemon("hub") as daemon:
        server.publish("org/private", directory)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)  # the daemon has no token of its own
        loaded = weightstream.load_weights(
            "hf://org/private", cache=str(daemon.socket), storage_options={"token": "hf_secret"}, zero_copy=False
        )
        assert_same(loaded, state)
        assert set(server.authorizations) == {"Bearer hf_secret"}
        assert server.cdn.authorizations and set(server.cdn.authorizations) == {None}, "the token went to the CDN"
        with pytest.raises(weightstream.NotFound, match=r"the token was refused or does not grant it"):
            weightstream.load_weights("hf://org/private", cache=str(daemon.socket), storage_options={"token": "x"})
