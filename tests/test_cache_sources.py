"""The node cache in front of the newer sources: an Azure blob and an OCI artifact filled once by a real daemon,
then attached (views of its segments), keyed by the blob's ETag or digest."""

from __future__ import annotations

from pathlib import Path

import pytest

import weightstream
from tests.cache_daemon import running_daemon, stats
from tests.conftest import assert_same, save_hf_sharded
from tests.test_objectstore import upload
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.save.push import push

pytestmark = pytest.mark.slow

SHAPE = LlamaShape(hidden=64, intermediate=160, layers=2, vocab=96)


@pytest.fixture(params=["az", "oci"])
def source(request) -> tuple[str, str]:
    """The source and its server (started before the test watches for leaks: it lives for the session)."""
    return request.param, request.getfixturevalue({"az": "azure_endpoint", "oci": "oci_address"}[request.param])


def test_a_checkpoint_is_filled_once_then_attached(source, tmp_path: Path, no_leaks):
    state = llama_state_dict(SHAPE, seed=12)
    local = save_hf_sharded(state, tmp_path / "ckpt", shards=2)
    scheme, server = source
    if scheme == "az":
        uri = upload("az", Path(local), f"cached-{tmp_path.name}")
    else:
        uri = f"oci://{server}/cached/model:v1"
        push(local, uri)
    with running_daemon("src") as daemon:
        first = weightstream.load_weights(uri, cache=str(daemon.socket))
        again = weightstream.load_weights(uri, cache=str(daemon.socket))
        counters = stats(daemon.socket)
        assert_same(first, state)
        assert_same(again, state)
        assert counters["fills"] == counters["entries"] >= 2, "every file filled once"
        assert counters["hits"] >= 2, "the second load attached"
        del first, again
