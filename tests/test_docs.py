"""Every code block of README.md, docs/ and CONTRIBUTING.md runs as written, in a fresh process, against small
fixtures: a tiny Llama checkpoint in ``model/`` and ``model.safetensors``, the same in ``s3://models/llama/`` on a
real S3 server (SeaweedFS), a cache daemon at ``$WEIGHTSTREAM_CACHE``, and ``my_model.build_model()`` standing for
the reader's model. A block that cannot run here says why in a comment before it
(``<!-- example: not run, REASON -->``), from a short list of reasons; ``<!-- example: ranks N -->`` runs a block as N
ranks of a gloo group. The generated tables (options, errors, figures) are checked current, every relative link
resolves, and every variable weightstream reads is in docs/environment.md."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cache_daemon import Daemon, remove
from tests.cache_daemon import places as cache_places
from tests.conftest import TINY_LLAMA, save_hf_sharded
from tests.objstore import free_port, s3_client
from weightstream.bench.demo import llama_state_dict

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python", "bash"}
NOT_RUN_REASONS = (
    ".ci/run runs",
    "a synopsis",
    "a snippet of",
    "needs vLLM",
    "needs SGLang",
    "the daemon runs in the foreground",
    "mounts a filesystem",
    "a listing",
    "starts a server on fixed ports",
)
"""Why a block may not run: what it is (a synopsis, a file's snippet, a listing) or what it needs that a test
machine has not (an engine, a foreground daemon, root mounts, ports a test running beside it may hold). Anything else
runs."""
BLOCK = re.compile(
    r"(?:<!-- example: (?P<directive>[^>]*?) -->\n)?```(?P<language>[a-z]*)\n(?P<code>.*?)\n```", re.DOTALL
)

MY_MODEL = '''"""The reader's model for the examples: modules named as the checkpoint's tensors, empty parameters."""

import torch

SHAPES = {shapes!r}


def build_model(device: str = "cpu") -> torch.nn.Module:
    root = torch.nn.Module()
    for name, shape in SHAPES.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16, device=device)))
    return root
'''


@dataclasses.dataclass(frozen=True)
class Block:
    document: Path
    line: int
    language: str
    code: str
    directive: str

    def __str__(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("language")) + 1
            found.append(Block(document, line, match["language"], match["code"], match["directive"] or ""))
    return found


BLOCKS = [block for block in blocks() if block.document.name != "architecture.md"]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory, s3_endpoint) -> Path:
    """The directory every example runs in (a fresh copy each): ``model/``, ``model.safetensors``, ``my_model.py``;
    and ``s3://models/llama/`` holding ``model/``."""
    from safetensors.torch import save_file

    directory = tmp_path_factory.mktemp("examples")
    state = llama_state_dict(TINY_LLAMA, seed=3)
    model = save_hf_sharded(state, directory / "model", shards=2)
    (model / "config.json").write_text('{"model_type": "llama"}')
    save_file(state, str(directory / "model.safetensors"), {"format": "pt"})
    shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
    (directory / "my_model.py").write_text(MY_MODEL.format(shapes=shapes))
    client = s3_client()
    try:
        client.create_bucket(Bucket="models")
        for path in sorted(model.iterdir()):
            client.put_object(Bucket="models", Key=f"llama/{path.name}", Body=path.read_bytes())
    finally:
        client.close()
    return directory


@pytest.fixture(scope="module")
def cache_socket(fixtures) -> Path:
    """A cache daemon the examples reach through ``$WEIGHTSTREAM_CACHE`` (started after the S3 server, so that it
    reads S3 with the session's credentials)."""
    directory, socket_path = cache_places("docs")
    with Daemon(directory, socket_path):
        yield socket_path
    remove(directory, socket_path)


def run_block(block: Block, workdir: Path, socket_path: Path) -> list[subprocess.CompletedProcess]:
    environment = {
        **os.environ,
        "WEIGHTSTREAM_CACHE": str(socket_path),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(workdir),
    }
    if block.language == "bash":
        command = ["bash", "-euo", "pipefail", "-c", block.code]
        return [
            subprocess.run(
                command, check=False, cwd=workdir, env=environment, capture_output=True, text=True, timeout=300
            )
        ]
    ranks = int(block.directive.split()[1]) if block.directive.startswith("ranks ") else 1
    port = str(free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", block.code],
            cwd=workdir,
            env={
                **environment,
                **(
                    {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks)}
                    | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
                    if ranks > 1
                    else {}
                ),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_the_example_runs_as_written(block: Block, fixtures: Path, cache_socket: Path, tmp_path: Path):
    if block.directive.startswith("not run, "):
        reason = block.directive.removeprefix("not run, ")
        assert reason.startswith(NOT_RUN_REASONS), f"{block}: {reason!r} is no reason to leave an example unrun"
        pytest.skip(f"not run: {reason}")
    assert block.language in RUNNABLE, f"{block}: a {block.language or 'plain'} block must run or say why it is not"
    workdir = tmp_path / "work"
    shutil.copytree(fixtures, workdir)
    for result in run_block(block, workdir, cache_socket):
        assert result.returncode == 0, (
            f"{block} failed:\n{block.code}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
        )
        assert "Traceback" not in result.stderr, f"{block}:\n{result.stderr}"


def test_few_examples_are_left_unrun():
    unrun = [str(block) for block in BLOCKS if block.directive.startswith("not run")]
    assert len(unrun) <= 10, unrun  # the 10th: docs/engines.md's vLLM recipe, checked line by line in test_engines
    assert 2 * (len(BLOCKS) - len(unrun)) >= 3 * len(unrun), "most examples run"


def test_the_generated_tables_are_current():
    from weightstream.errors_table import BEGIN as ERRORS_BEGIN
    from weightstream.errors_table import END as ERRORS_END
    from weightstream.errors_table import errors_table
    from weightstream.options_table import BEGIN, END, options_table

    api = (ROOT / "docs" / "api.md").read_text()
    assert api[api.index(BEGIN) : api.index(END) + len(END)] == options_table()
    errors = (ROOT / "docs" / "errors.md").read_text()
    assert errors[errors.index(ERRORS_BEGIN) : errors.index(ERRORS_END) + len(ERRORS_END)] == errors_table(), (
        "docs/errors.md's table is stale: run python -m weightstream.errors_table docs/errors.md"
    )
    figures = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "figures.py"), "--check"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert figures.returncode == 0, f"the figures are stale (python benchmarks/figures.py): {figures.stdout}"


def test_every_relative_link_resolves():
    broken = []
    for document in [*DOCUMENTS, ROOT / "benchmarks" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", document.read_text()):
            if "://" not in target and not (document.parent / target).exists():
                broken.append(f"{document.relative_to(ROOT)}: {target}")
    assert broken == []


def test_every_variable_read_is_documented():
    documented = (ROOT / "docs" / "environment.md").read_text()
    prefixes = "WEIGHTSTREAM|AWS|AZURE|HF|HUGGINGFACE|GOOGLE|STORAGE|DOCKER|XDG|GCSFS"
    variable = re.compile(rf"[\"']((?:{prefixes})_[A-Z_]+)[\"']")
    read = set()
    for path in (ROOT / "weightstream").rglob("*.py"):
        read |= set(variable.findall(path.read_text()))
    missing = sorted(name for name in read if name not in documented)
    assert missing == []
    assert {"WEIGHTSTREAM_CACHE", "WEIGHTSTREAM_LOG", "HF_TOKEN", "AZURE_STORAGE_ACCOUNT_KEY"} <= read
