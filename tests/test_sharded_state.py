"""The sharded-state saver and loader: round trips, per-rank byte accounting, manifest checks,
checksums, engine-written directories, crashes (SIGKILL), concurrent saves, a full disk, and the
rank from a real torch.distributed group."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import weightstream
from tests.conftest import assert_same
from tests.sharded_saver import state as saver_state
from weightstream.bench.demo import LlamaShape, llama_state_dict
from weightstream.checkpoint import opening
from weightstream.sources.local.file import LocalStore

SHAPE = LlamaShape(hidden=128, intermediate=352, layers=3, vocab=500)
ROOT = Path(__file__).parent.parent


def split_for(world_size: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """A different state dict per rank (what each tensor-parallel rank holds after sharding)."""
    return [
        {f"{name}.r{rank}": tensor for name, tensor in llama_state_dict(SHAPE, seed=seed + rank).items()}
        for rank in range(world_size)
    ]


def save_world(
    directory: Path, world_size: int, max_file_bytes: int = 1 << 30, **options
) -> list[dict[str, torch.Tensor]]:
    states = split_for(world_size)
    for rank, state in enumerate(states):
        weightstream.save_sharded_state(
            state, directory, rank=rank, world_size=world_size, max_file_bytes=max_file_bytes, **options
        )
    return states


# Round trips


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("max_file_bytes", [64 << 10, 1 << 30])
def test_each_rank_loads_its_own_state_bit_exact(tmp_path: Path, world_size, max_file_bytes, no_leaks):
    states = save_world(tmp_path, world_size, max_file_bytes)
    for rank, state in enumerate(states):
        assert_same(
            weightstream.load_weights(tmp_path, format="sharded-state", rank=rank, world_size=world_size), state
        )
        assert_same(weightstream.load_weights(tmp_path, format="sharded-state", rank=rank, verify=True), state)
    parts = sorted(p.name for p in tmp_path.glob("model-rank-0-part-*.safetensors"))
    if max_file_bytes == 64 << 10:
        assert len(parts) > 3, "a small limit splits a rank into many parts"
        assert all((tmp_path / p).stat().st_size < 64 << 10 or len(safetensors_names(tmp_path / p)) == 1 for p in parts)
    else:
        assert parts == ["model-rank-0-part-0.safetensors"]


def safetensors_names(path: Path) -> list[str]:
    length = int.from_bytes(path.read_bytes()[:8], "little")
    return [key for key in json.loads(path.read_bytes()[8 : 8 + length]) if key != "__metadata__"]


def test_a_world_of_one_needs_no_rank(tmp_path: Path, no_leaks):
    (state,) = save_world(tmp_path, 1)
    assert_same(weightstream.load_weights(tmp_path, format="sharded-state"), state)


def test_pipeline_parallel_pattern_and_custom_patterns(tmp_path: Path, no_leaks):
    states = {}
    for pp in range(2):
        for tp in range(2):
            states[pp, tp] = split_for(1, seed=10 * pp + tp)[0]
            weightstream.save_sharded_state(
                states[pp, tp],
                tmp_path / "pp",
                rank=(pp, tp),
                world_size=(2, 2),
                pattern="model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors",
            )
    assert (tmp_path / "pp" / "model-pp-1-tp-0-part-0.safetensors").exists()
    for rank, state in states.items():
        assert_same(
            weightstream.load_weights(
                tmp_path / "pp", format="sharded-state", rank=rank, world_size=(2, 2), verify=True
            ),
            state,
        )
    custom = "weights-tp{rank}-{part}.safetensors"
    custom_states = save_world(tmp_path / "custom", 2, 64 << 10, pattern=custom)
    assert (tmp_path / "custom" / "weights-tp1-0.safetensors").exists()
    assert_same(weightstream.load_weights(tmp_path / "custom", format="sharded-state", rank=1), custom_states[1])


def test_a_rank_reads_no_byte_of_another_ranks_files(tmp_path: Path, monkeypatch, no_leaks):
    save_world(tmp_path, 3, 64 << 10)
    reads: dict[str, int] = {}

    class CountingStore(LocalStore):
        def open(self, uri, *, direct=False):
            source = super().open(uri, direct=direct)
            read_into, read = source.read_into, source.read

            def counted_read_into(offset, buffer):
                reads[os.path.basename(uri)] = reads.get(os.path.basename(uri), 0) + len(buffer)
                return read_into(offset, buffer)

            def counted_read(offset, nbytes):
                reads[os.path.basename(uri)] = reads.get(os.path.basename(uri), 0) + nbytes
                return read(offset, nbytes)

            source.read_into, source.read = counted_read_into, counted_read
            return source

    monkeypatch.setattr(opening, "locate", lambda uri, *args: (CountingStore(), uri))
    weightstream.load_weights(tmp_path, format="sharded-state", rank=1, world_size=3, verify=True)
    own = {p.name for p in tmp_path.glob("model-rank-1-part-*.safetensors")} | {"weightstream-manifest-rank-1.json"}
    assert set(reads) == own, f"read files of other ranks: {sorted(set(reads) - own)}"
    data = sum(p.stat().st_size for p in tmp_path.glob("model-rank-1-part-*.safetensors"))
    assert reads.keys() and sum(reads[name] for name in own if name.endswith(".safetensors")) >= data


# Manifest checks


def test_world_size_mismatch_is_a_typed_error(tmp_path: Path, no_leaks):
    save_world(tmp_path, 2)
    with pytest.raises(
        weightstream.ManifestError,
        match=r"weightstream-manifest-rank-1.json: saved for a world size of 2; this load runs with 4",
    ):
        weightstream.load_weights(tmp_path, format="sharded-state", rank=1, world_size=4)


def test_a_missing_part_is_a_typed_error(tmp_path: Path, no_leaks):
    save_world(tmp_path, 2, 64 << 10)
    (tmp_path / "model-rank-1-part-2.safetensors").unlink()
    with pytest.raises(
        weightstream.ManifestError,
        match=r"lists model-rank-1-part-2.safetensors, which is not in .* \(1 of \d+ files missing\)",
    ):
        weightstream.load_weights(tmp_path, format="sharded-state", rank=1)


def test_extra_files_are_typed_errors(tmp_path: Path, no_leaks):
    save_world(tmp_path, 2)
    shutil.copy(tmp_path / "model-rank-1-part-0.safetensors", tmp_path / "model-rank-1-part-1.safetensors")
    with pytest.raises(
        weightstream.ManifestError,
        match=r"model-rank-1-part-1.safetensors is a file of rank 1 that .* does not list \(an extra file\)",
    ):
        weightstream.load_weights(tmp_path, format="sharded-state", rank=1)
    (tmp_path / "model-rank-1-part-1.safetensors").unlink()
    shutil.copy(tmp_path / "model-rank-1-part-0.safetensors", tmp_path / "model-rank-2-part-0.safetensors")
    with pytest.raises(
        weightstream.ManifestError,
        match=r"model-rank-2-part-0.safetensors belongs to rank 2, outside the saved world size 2",
    ):
        weightstream.load_weights(tmp_path, format="sharded-state", rank=0)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda doc: doc.update(version=2),
            r"version 2; this weightstream reads 'weightstream.sharded-state' version 1",
        ),
        (lambda doc: doc.pop("checksum"), r"the manifest lacks 'checksum'"),
        (lambda doc: doc.update(checksum="md5"), r"checksum 'md5' is not one of xxh3-128, sha256"),
        (lambda doc: doc["files"][0].update(size=-1), r"files\[0\].size must be a non-negative integer, got -1"),
        (
            lambda doc: doc["files"][0].update(name="model-rank-1-part-0.safetensors"),
            r"files\[0\] is 'model-rank-1-part-0.safetensors', but part 0 of 0 is",
        ),
        (
            lambda doc: doc["files"][0]["tensors"][0].update(offset=9),
            r"tensor '.*' is at bytes \d+-\d+, the manifest says 9-",
        ),
        (
            lambda doc: doc["files"][0].update(size=doc["files"][0]["size"] + 1),
            r"bytes, the manifest says \d+ \(the file changed after the save\)",
        ),
        (
            lambda doc: doc.update(pattern="model-rank-{rank:>300000000}-part-{part}.safetensors"),
            r"uses \{rank:>300000000\}; placeholders take no format spec or conversion",
        ),
        (
            lambda doc: doc.update(pattern="model-rank-{rank:>1e20}-part-{part}.safetensors"),
            r"uses \{rank:>1e20\}; placeholders take no format spec or conversion",
        ),
        (
            lambda doc: doc.update(pattern="model-rank-{rank!r}-part-{part}.safetensors"),
            r"uses \{rank!r\}; placeholders take no format spec or conversion",
        ),
        (
            lambda doc: doc["files"][0].update(name="model-rank-" + "9" * 5000 + "-part-0.safetensors"),
            r"files\[0\] is 'model-rank-9{5000}-part-0.safetensors', but part 0 of 0 is",
        ),
    ],
)
def test_a_wrong_manifest_is_a_typed_error_before_any_tensor_read(tmp_path: Path, edit, message, no_leaks):
    save_world(tmp_path, 1)
    path = tmp_path / "weightstream-manifest-rank-0.json"
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))
    reads = []
    with pytest.raises(weightstream.ManifestError, match=message):
        weightstream.iter_weights(tmp_path, format="sharded-state", progress=reads.append)
    assert reads == []


def test_a_manifest_that_is_not_json(tmp_path: Path, no_leaks):
    save_world(tmp_path, 1)
    (tmp_path / "weightstream-manifest-rank-0.json").write_bytes(b'{"format": ')
    with pytest.raises(weightstream.ManifestError, match=r"weightstream-manifest-rank-0.json is not valid JSON"):
        weightstream.load_weights(tmp_path, format="sharded-state")


# Checksums


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


def test_a_corrupt_tensor_is_named_by_verify(tmp_path: Path, no_leaks):
    save_world(tmp_path, 2, 64 << 10)
    manifest = json.loads((tmp_path / "weightstream-manifest-rank-1.json").read_text())
    victim = manifest["files"][1]["tensors"][0]
    flip_byte(tmp_path / manifest["files"][1]["name"], victim["offset"] + victim["nbytes"] // 2)
    name, start, end = victim["name"], victim["offset"], victim["offset"] + victim["nbytes"]
    with pytest.raises(
        weightstream.IntegrityError,
        match=rf"model-rank-1-part-1.safetensors: tensor '{name}' \(bytes {start}-{end}\) has xxh3-128 \w+, the "
        rf"manifest says {victim['checksum']}",
    ):
        weightstream.load_weights(tmp_path, format="sharded-state", rank=1, verify=True)
    loaded = weightstream.load_weights(tmp_path, format="sharded-state", rank=1)  # without verify: read as it is
    assert name in loaded


def test_a_corrupt_header_is_named_by_verify(tmp_path: Path, no_leaks):
    save_world(tmp_path, 1, checksum="sha256")
    part = tmp_path / "model-rank-0-part-0.safetensors"
    raw = part.read_bytes()
    part.write_bytes(raw.replace(b'"format":"pt"', b'"format":"pu"', 1))  # still a valid header, same length
    with pytest.raises(
        weightstream.IntegrityError,
        match=r"model-rank-0-part-0.safetensors: the header \(bytes 0-\d+\) has sha256 \w+, the manifest says",
    ):
        weightstream.load_weights(tmp_path, format="sharded-state", verify=True)


def test_the_file_checksum_is_the_xxh128_of_the_file(tmp_path: Path):
    import xxhash

    save_world(tmp_path, 1, 64 << 10)
    for entry in json.loads((tmp_path / "weightstream-manifest-rank-0.json").read_text())["files"]:
        assert xxhash.xxh3_128_hexdigest((tmp_path / entry["name"]).read_bytes()) == entry["checksum"]


def test_verify_needs_a_manifest_and_the_host(tmp_path: Path, no_leaks):
    state = split_for(1)[0]
    save_file(state, str(tmp_path / "model-rank-0-part-0.safetensors"))
    with pytest.raises(weightstream.InvalidOptionError, match=r"verify=True: .* has no manifest for this rank"):
        weightstream.load_weights(tmp_path, format="sharded-state", verify=True)
    with pytest.raises(weightstream.InvalidOptionError, match=r"verify=True checks bytes on the host"):
        weightstream.iter_weights(tmp_path, format="sharded-state", verify=True, device="cuda")


# Directories the engines write (no manifest)


def test_engine_directories_load_by_their_naming(tmp_path: Path, no_leaks):
    states = split_for(2)
    for rank, state in enumerate(states):
        names = list(state)
        save_file({n: state[n] for n in names[:10]}, str(tmp_path / f"model-rank-{rank}-part-0.safetensors"))
        save_file({n: state[n] for n in names[10:]}, str(tmp_path / f"model-rank-{rank}-part-1.safetensors"))
    assert_same(weightstream.load_weights(tmp_path, format="sharded-state", rank=1, world_size=2), states[1])
    with pytest.raises(
        weightstream.NotFound, match=r"no file of rank 2 named like 'model-rank-\{rank\}-part-\{part\}.safetensors'"
    ):
        weightstream.load_weights(tmp_path, format="sharded-state", rank=2)
    with pytest.raises(
        weightstream.ManifestError, match=r"model-rank-1-part-0.safetensors belongs to rank 1, outside the world size 1"
    ):
        weightstream.load_weights(tmp_path, format="sharded-state", rank=0, world_size=1)
    (tmp_path / "model-rank-1-part-0.safetensors").unlink()
    with pytest.raises(
        weightstream.ManifestError, match=r"rank 1 has parts up to 1 but not part 0 \(model-rank-1-part-0.safetensors\)"
    ):
        weightstream.load_weights(tmp_path, format="sharded-state", rank=1)


def test_an_unfinished_save_is_refused(tmp_path: Path, no_leaks):
    save_world(tmp_path, 2)
    (tmp_path / ".weightstream-saving-rank-1").write_text("1234-abcd")
    with pytest.raises(
        weightstream.IncompleteSaveError,
        match=r"a save of rank 1 did not finish \(or is running\): .weightstream-saving-rank-1 is there",
    ):
        weightstream.load_weights(tmp_path, format="sharded-state", rank=1)
    weightstream.load_weights(tmp_path, format="sharded-state", rank=0)


# Options


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"rank": 2, "world_size": 2}, r"rank 2 is not in a world of size 2"),
        ({"rank": (0, 1), "world_size": 2}, r"rank must be a non-negative integer for pattern"),
        (
            {"rank": 0, "world_size": 1, "pattern": "model-{part}.safetensors"},
            r"must use either \{rank\} or both \{pp_rank\} and \{tp_rank\}",
        ),
        (
            {"rank": 0, "world_size": 1, "pattern": "sub/model-{rank}-{part}.safetensors"},
            r"must name a .safetensors file in the directory itself",
        ),
        ({"rank": 0, "world_size": 1, "pattern": "model-{rank}-{part}-{layer}.safetensors"}, r"uses \{layer\}"),
        ({"rank": 0, "world_size": 1, "max_file_bytes": 0}, r"max_file_bytes must be a positive integer, got 0"),
        ({"rank": 0, "world_size": 1, "checksum": "md5"}, r"checksum must be one of xxh3-128, sha256, got 'md5'"),
    ],
)
def test_bad_save_arguments_write_nothing(tmp_path: Path, arguments, message):
    with pytest.raises(weightstream.InvalidOptionError, match=message):
        weightstream.save_sharded_state(split_for(1)[0], tmp_path / "out", **arguments)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("loader", ["safetensors", "streaming", "layered"])
@pytest.mark.parametrize("option", [{"rank": 0}, {"verify": True}, {"shard_pattern": "x-{rank}-{part}.safetensors"}])
def test_other_loaders_refuse_the_sharded_options(tmp_path: Path, loader, option, tiny_state, no_leaks):
    save_file(tiny_state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        weightstream.InvalidOptionError,
        match=rf"{next(iter(option))}: an option of format='sharded-state'; the {loader} loader does not use it",
    ):
        weightstream.iter_weights(tmp_path / "model.safetensors", format=loader, **option)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rank": 3, "world_size": 2}, r"rank 3 is not in a world of size 2"),
        (
            {"rank": 0, "world_size": (1, 2)},
            r"rank 0 and world_size \(1, 2\) must both be integers or both \(pp, tp\) pairs",
        ),
        ({"rank": -1}, r"rank must be a non-negative integer or a \(pp, tp\) pair of them, got -1"),
    ],
)
def test_bad_load_ranks_are_refused_before_any_read(tmp_path: Path, options, message, no_leaks):
    save_world(tmp_path, 2)
    with pytest.raises(weightstream.InvalidOptionError, match=message):
        weightstream.iter_weights(tmp_path, format="sharded-state", **options)


def test_without_a_rank_a_world_of_several_is_refused(tmp_path: Path, no_leaks):
    save_world(tmp_path, 2)
    with pytest.raises(
        weightstream.InvalidOptionError, match=r"reads one rank's files \(ranks here: rank 0, rank 1\): pass rank="
    ):
        weightstream.load_weights(tmp_path, format="sharded-state")


# Crashes, concurrency, a full disk


def saved_seconds(printed: str) -> list[float]:
    """The durations ``tests.sharded_saver`` printed (``saved SECONDS`` lines)."""
    return [float(line.split()[1]) for line in printed.splitlines() if line.startswith("saved ")]


def calibrated_save_seconds(directory: Path) -> float:
    """How long one save of ``tests.sharded_saver`` takes on this machine now (the longest of three)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.sharded_saver", str(directory), "2", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return max(saved_seconds(done.stdout))


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.slow
def test_sigkill_at_random_points_leaves_the_old_state_or_nothing_loadable(tmp_path: Path):
    old, new = saver_state(1), saver_state(2)
    weightstream.save_sharded_state(old, tmp_path, rank=0, world_size=1, max_file_bytes=256 << 10)
    rng = random.Random(5)
    outcomes = {"old": 0, "refused": 0, "new": 0}
    save_seconds = calibrated_save_seconds(tmp_path / "calibration")
    for attempt in range(60):  # each kill lands before a save (old), mid-way (refused) or after one (new)
        saver = subprocess.Popen(
            [sys.executable, "-m", "tests.sharded_saver", str(tmp_path), "2", "3"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert saver.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0, 2.5 * save_seconds))  # the three saves span about 3 save times
        saver.send_signal(signal.SIGKILL)
        printed, _ = saver.communicate()
        save_seconds = max(saved_seconds(printed), default=save_seconds)  # the machine's pace now: follow it
        try:
            loaded = weightstream.load_weights(tmp_path, format="sharded-state", verify=True)
        except weightstream.IncompleteSaveError:
            outcomes["refused"] += 1
        else:
            landed = "new" if torch.equal(loaded["lm_head.weight"], new["lm_head.weight"]) else "old"
            assert_same(loaded, new if landed == "new" else old)  # all of one state, never a mix
            outcomes[landed] += 1
        weightstream.save_sharded_state(
            old, tmp_path, rank=0, world_size=1, max_file_bytes=256 << 10
        )  # back to the old state
        assert not [name for name in listing(tmp_path) if name.startswith(".")], (
            "a later save sweeps what a killed save left"
        )
        if attempt >= 7 and all(outcomes.values()):
            break
    assert all(outcomes.values()), f"the kills did not land at every stage: {outcomes}"
    assert_same(weightstream.load_weights(tmp_path, format="sharded-state", verify=True), old)


@pytest.mark.slow
def test_two_concurrent_saves_end_with_one_complete_winner(tmp_path: Path):
    for _ in range(3):
        savers = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.sharded_saver", str(tmp_path), str(seed), "2"],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
            )
            for seed in (3, 4)
        ]
        for saver in savers:
            output, _ = saver.communicate(timeout=120)
            assert saver.returncode == 0 and output.count("saved") == 2
        loaded = weightstream.load_weights(tmp_path, format="sharded-state", verify=True)
        winner = (
            saver_state(3)
            if torch.equal(loaded["lm_head.weight"], saver_state(3)["lm_head.weight"])
            else saver_state(4)
        )
        assert_same(loaded, winner)
        assert not [name for name in listing(tmp_path) if name.startswith(".")]


def small_filesystem_command(directory: Path) -> list[str] | None:
    """A command that runs the full-disk script on a 2 MiB tmpfs at ``directory``, in a private mount namespace."""
    if shutil.which("unshare") is None:
        return None
    script = (
        f"mount -t tmpfs -o size=2m tmpfs {directory} && exec {sys.executable} -m tests.sharded_full_disk {directory}"
    )
    prefix = (
        ["unshare", "--mount", "--propagation", "private"]
        if os.geteuid() == 0
        else ["unshare", "--user", "--map-root-user", "--mount"]
    )
    return [*prefix, "sh", "-c", script]


@pytest.mark.slow
def test_a_full_disk_is_a_typed_error_and_leaves_no_partial_files(tmp_path: Path):
    directory = tmp_path / "small"
    directory.mkdir()
    command = small_filesystem_command(directory)
    probe = (
        subprocess.run(
            ["unshare", "--mount", "true"]
            if os.geteuid() == 0
            else ["unshare", "--user", "--map-root-user", "--mount", "true"],
            capture_output=True,
            check=False,
        )
        if command
        else None
    )
    if command is None or probe.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {probe.stderr.decode().strip() if probe else 'no unshare'}")
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    kind, message, is_os_error = outcome["error"]
    assert kind == "SaveError" and is_os_error
    assert "No space left on device" in message and "saving rank 0 into" in message
    assert outcome["after"] == outcome["before"]
    assert outcome["first_state_intact"]


# torch.distributed


@pytest.mark.slow
def test_the_rank_comes_from_torch_distributed(tmp_path: Path):
    states = save_world(tmp_path / "ckpt", 2)
    script = (
        "import os, sys, torch, torch.distributed as dist, weightstream\n"
        "dist.init_process_group('gloo', init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)\n"
        "loaded = weightstream.load_weights(sys.argv[3], format='sharded-state', verify=True)\n"
        "torch.save(loaded, sys.argv[4])\n"
        "dist.destroy_process_group()\n"
    )
    init = f"file://{tmp_path / 'rendezvous'}"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, init, str(rank), str(tmp_path / "ckpt"), str(tmp_path / f"out-{rank}.pt")],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for process in ranks:
        _, errors = process.communicate(timeout=120)
        assert process.returncode == 0, errors
    for rank in range(2):
        assert_same(torch.load(tmp_path / f"out-{rank}.pt"), states[rank])


# Object stores


@pytest.mark.slow
def test_a_rank_of_a_state_in_an_object_store(scheme, tmp_path: Path, no_leaks):
    from tests.test_objectstore import upload

    states = save_world(tmp_path / "local", 2, 64 << 10)
    uri = upload(scheme, tmp_path / "local", "sharded-state")
    assert_same(weightstream.load_weights(uri, format="sharded-state", rank=1, world_size=2, verify=True), states[1])


def test_a_window_is_refused(tmp_path: Path, no_leaks):
    save_world(tmp_path, 1)
    with pytest.raises(
        weightstream.InvalidOptionError,
        match=r"max_inflight_bytes: an option of format='streaming'; the sharded-state loader does not use it",
    ):
        weightstream.iter_weights(tmp_path, format="sharded-state", max_inflight_bytes=64 << 20)


def test_a_rank_of_hundreds_of_digits_names_no_file_of_ours(tmp_path: Path, no_leaks):
    """A file name holds at most 255 bytes (a manifest, above, is where 5,000 digits can hide)."""
    state = split_for(1)[0]
    save_file(state, str(tmp_path / "model-rank-0-part-0.safetensors"))
    save_file(state, str(tmp_path / ("model-rank-" + "7" * 220 + "-part-0.safetensors")))
    assert_same(weightstream.load_weights(tmp_path, format="sharded-state", rank=0), state)


def test_a_finished_save_leaves_only_the_checkpoint(tmp_path: Path, no_leaks):
    save_world(tmp_path, 2, max_file_bytes=64 << 10)
    names = listing(tmp_path)
    assert all(
        name.startswith("model-rank-")
        and name.endswith(".safetensors")
        or name.startswith("weightstream-manifest-rank-")
        for name in names
    ), names
    assert not [name for name in names if name.startswith(".") or name.endswith(".lock")]


def test_saving_into_a_file_or_an_unwritable_place_is_a_save_error(tmp_path: Path, no_leaks):
    state = split_for(1)[0]
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    with pytest.raises(
        weightstream.SaveError, match=r"cannot save into .*a-file: it is a file, not a directory"
    ) as caught:
        weightstream.save_sharded_state(state, a_file, rank=0, world_size=1)
    assert caught.value.errno == errno.ENOTDIR
    with pytest.raises(
        weightstream.SaveError, match=r"saving rank 0 into .*a-file/below failed: Not a directory"
    ) as caught:
        weightstream.save_sharded_state(state, a_file / "below", rank=0, world_size=1)
    assert caught.value.errno == errno.ENOTDIR
    with pytest.raises(
        weightstream.SaveError, match=r"saving rank 0 into /sys/weightstream-test/state failed: Operation not permitted"
    ) as caught:
        weightstream.save_sharded_state(state, "/sys/weightstream-test/state", rank=0, world_size=1)
    assert caught.value.errno == errno.EPERM


def test_the_cli_reports_a_save_error_without_a_traceback(tmp_path: Path, tiny_state):
    from tests.conftest import save_hf_sharded

    source = save_hf_sharded(tiny_state, tmp_path / "hf", shards=1)
    (tmp_path / "taken").write_text("x")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightstream.cli",
            "convert",
            str(source),
            str(tmp_path / "taken"),
            "--to",
            "sharded-state",
            "--tp",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "weightstream: error: cannot save into" in result.stderr and "it is a file, not a directory" in result.stderr


@pytest.mark.slow
def test_a_load_during_a_save_of_its_rank_never_mixes_two_saves(tmp_path: Path, no_leaks):
    first, second = split_for(1, seed=1)[0], split_for(1, seed=7)[0]
    weightstream.save_sharded_state(first, tmp_path, rank=0, world_size=1, max_file_bytes=16 << 10)
    stop = threading.Event()
    saves = [0]

    def keep_saving() -> None:
        while not stop.is_set():
            weightstream.save_sharded_state(
                second if saves[0] % 2 == 0 else first, tmp_path, rank=0, world_size=1, max_file_bytes=16 << 10
            )
            saves[0] += 1

    saver = threading.Thread(target=keep_saving)
    saver.start()
    outcomes = {"whole": 0, "changed": 0, "incomplete": 0}
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            try:
                loaded = weightstream.load_weights(tmp_path, format="sharded-state", rank=0, threads=2)
            except weightstream.SourceChangedError:
                outcomes["changed"] += 1
                continue
            except (weightstream.IncompleteSaveError, weightstream.ManifestError, weightstream.NotFound):
                outcomes["incomplete"] += 1  # caught between a save's renames and its manifest: refused, not mixed
                continue
            one = all(torch.equal(loaded[name], first[name]) for name in first)
            other = all(torch.equal(loaded[name], second[name]) for name in second)
            assert one or other, "a load returned tensors of two saves"
            outcomes["whole"] += 1
    finally:
        stop.set()
        saver.join()
    assert saves[0] > 5 and outcomes["whole"] > 0, (saves, outcomes)


@pytest.mark.slow
def test_a_rank_of_a_state_pushed_to_an_oci_registry(oci_address, tmp_path: Path, no_leaks):
    from weightstream.save.push import push

    states = save_world(tmp_path / "local", 2, 64 << 10)
    uri = f"oci://{oci_address}/sharded/state:v1"
    push(str(tmp_path / "local"), uri)
    assert_same(weightstream.load_weights(uri, format="sharded-state", rank=1, world_size=2, verify=True), states[1])
