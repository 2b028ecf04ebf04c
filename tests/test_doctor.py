"""``weightstream doctor``: every finding named, credentials found and never printed, O_DIRECT checked where the
checkpoints are, the cache daemon found, a problem made the exit status; run as a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cache_daemon import Daemon, remove
from tests.cache_daemon import places as cache_places

NAMES = {
    "system",
    "torch",
    "o_direct",
    "transparent_huge_pages",
    "cache_tmpfs",
    "botocore",
    "gcsfs",
    "cuda-bindings",
    "vllm",
    "credentials s3://",
    "credentials hf://",
    "credentials oci://",
    "cache_daemon",
}


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightstream.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


def findings(result: subprocess.CompletedProcess) -> dict[str, dict]:
    report = json.loads(result.stdout)
    by_name = {finding["name"]: finding for finding in report["findings"]}
    problems = sum(finding["status"] == "problem" for finding in report["findings"])
    assert report["problems"] == problems and result.returncode == (1 if problems else 0)
    return by_name


def test_every_check_reports_and_secrets_stay_secret(tmp_path: Path):
    home = tmp_path / "home"
    (home / ".docker").mkdir(parents=True)
    (home / ".docker" / "config.json").write_text('{"auths": {"r.example": {"auth": "dXNlcjpodW50ZXIy"}}}')
    secrets = {"AWS_ACCESS_KEY_ID": "AKIASECRETVALUE", "HF_TOKEN": "hf_secret_token_value", "HOME": str(home)}
    result = doctor(str(tmp_path), "--json", env={**secrets, "WEIGHTSTREAM_CACHE": str(tmp_path / "none.sock")})
    found = findings(result)
    assert NAMES <= set(found)
    assert all(finding["status"] in ("ok", "note", "problem") for finding in found.values())
    assert found["credentials s3://"]["status"] == "ok" and "AWS_ACCESS_KEY_ID" in found["credentials s3://"]["detail"]
    assert found["credentials hf://"]["detail"].startswith("found in HF_TOKEN")
    assert found["credentials oci://"]["status"] == "ok"
    for secret in ("AKIASECRETVALUE", "hf_secret_token_value", "dXNlcjpodW50ZXIy"):
        assert secret not in result.stdout and secret not in result.stderr
    assert found["cache_daemon"]["status"] == "note" and "none.sock: no such socket" in found["cache_daemon"]["detail"]
    assert list(tmp_path.iterdir()) == [home], "the O_DIRECT probe left its temporary file"


def test_o_direct_of_a_directory_on_a_file_of_its_own_and_missing_extras_name_their_install(tmp_path: Path):
    """A directory holding a checkpoint: the probe reads a file it made there (and removed), never the checkpoint;
    a missing optional library says which extra installs it."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 8192)
    found = findings(doctor(str(tmp_path), "--json"))
    assert found["o_direct"]["detail"].startswith(f"{tmp_path} (a file of its own there): "), found["o_direct"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.safetensors"]
    absent = [finding for finding in found.values() if finding["detail"].startswith("not installed")]
    if not absent:
        pytest.skip("every optional library is installed here")
    for finding in absent:
        assert re.search(
            r": (pip install 'weightstream\[\w+\]'|see docs/engines\.md for its install)$", finding["detail"]
        )


def test_o_direct_of_a_file_and_of_nothing(tmp_path: Path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 8192)
    checked = findings(doctor(str(weights), "--json"))["o_direct"]
    assert checked["detail"].startswith(str(weights))
    missing = doctor(str(tmp_path / "missing"))
    assert missing.returncode == 1
    assert (
        "problem  o_direct" in missing.stdout and f"{tmp_path / 'missing'}: no such file or directory" in missing.stdout
    )
    assert missing.stdout.strip().endswith("problem(s)")


def test_a_running_cache_daemon_is_found(tmp_path: Path):
    directory, socket_path = cache_places("doctor")
    try:
        with Daemon(directory, socket_path):
            found = findings(doctor(str(tmp_path), "--json", env={"WEIGHTSTREAM_CACHE": str(socket_path)}))
    finally:
        remove(directory, socket_path)
    assert found["cache_daemon"] == {"name": "cache_daemon", "status": "ok", "detail": f"answers at {socket_path}"}


def test_a_check_that_breaks_is_a_problem_and_the_others_run(monkeypatch):
    from weightstream.cli import doctor as module

    def broken():
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(module, "_huge_pages", broken)
    results = module.run_checks(".")
    broke = next(finding for finding in results if finding.name == "huge_pages")
    assert (broke.status, broke.detail) == ("problem", "the check failed: OSError(5, 'Input/output error')")
    assert {"system", "o_direct", "cache_daemon"} <= {finding.name for finding in results}
