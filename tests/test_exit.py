"""An abandoned iterator never holds the interpreter at exit: its queued reads are skipped, and the
layered loader's keeper (waiting for buffers its caller never gives back) does not block."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from weightstream.save.write import write_safetensors

ROOT = Path(__file__).resolve().parents[1]
READS = 2048
READ_SECONDS = 0.05
LOAD_SECONDS = READS * READ_SECONDS / 2
"""What the whole load takes on 2 threads (about 51 s): an exit that waited for it is told from a slow
interpreter teardown on a busy machine (over 2 s seen) by a wide margin."""
SCRIPT = f"""
import sys, time, weightstream
from weightstream.sources.local.file import LocalFile
read_into = LocalFile.read_into
def slow(self, offset, buffer):
    time.sleep({READ_SECONDS})
    read_into(self, offset, buffer)
LocalFile.read_into = slow
kind, path = sys.argv[1], sys.argv[2]
if kind == "iter_layers":
    iterator = weightstream.iter_layers(path, threads=2, chunk_bytes=4096)
elif kind == "open":
    checkpoint = weightstream.open(path, threads=2, chunk_bytes=4096)  # never closed either
    iterator = checkpoint.iter_weights()
else:
    iterator = weightstream.iter_weights(path, format=kind, threads=2, chunk_bytes=4096)
first = next(iterator)  # held to the end: the iterator is abandoned, never closed
print(time.time(), flush=True)
"""


@pytest.fixture(scope="module")
def many_reads(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("exit") / "many.safetensors"
    write_safetensors(
        path, {f"model.layers.{n // 16}.w{n % 16}": torch.full((1024,), n, dtype=torch.int32) for n in range(READS)}
    )
    return path


@pytest.mark.parametrize("kind", ["safetensors", "streaming", "layered", "iter_layers", "open"])
def test_an_abandoned_iterator_does_not_hold_the_interpreter_at_exit(many_reads: Path, kind):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, kind, str(many_reads)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=2 * LOAD_SECONDS,
        check=False,
    )
    ended = time.time()
    assert result.returncode == 0, result.stderr[-2000:]
    abandoned = float(result.stdout.strip().splitlines()[-1])
    assert ended - abandoned < LOAD_SECONDS / 3, (
        f"{ended - abandoned:.1f} s from the abandoned iterator to the exit: its queued reads ran, or a thread held it"
    )


LATE_SCRIPT = """
import sys, threading, time, torch, weightstream
path = sys.argv[1]
def expected(name):  # model.layers.<layer>.w<n>: value 16 * layer + n
    return 16 * int(name.split(".")[2]) + int(name.rsplit("w", 1)[1])
def load():
    threading.main_thread().join()  # this load starts once the main thread has ended
    for format in ("safetensors", "streaming", "layered"):
        tensors = weightstream.load_weights(path, format=format, threads=2, chunk_bytes=4096)
        wrong = [name for name, tensor in tensors.items() if tensor[0].item() != expected(name)]
        print(format, len(tensors), len(wrong), flush=True)
threading.Thread(target=load).start()
"""


def test_a_load_in_a_thread_that_outlives_the_main_thread_reads_every_tensor(many_reads: Path):
    result = subprocess.run(
        [sys.executable, "-c", LATE_SCRIPT, str(many_reads)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr == ""
    assert result.stdout.splitlines() == [f"{format} {READS} 0" for format in ("safetensors", "streaming", "layered")]
