"""The optional backends of the remote sources: too old a release is a typed error naming both versions,
before any request (an old s3fs once failed every load with a retried ``TypeError``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from weightstream.sources.dependencies import MINIMUM_VERSIONS, release

ROOT = Path(__file__).resolve().parents[1]


def fake_distribution(directory: Path, name: str, version: str) -> Path:
    """A dist-info directory that importlib.metadata finds first on ``sys.path``."""
    info = directory / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return directory


@pytest.mark.parametrize(
    ("uri", "name", "old"),
    [
        ("s3://bucket/model/", "botocore", "1.0.0"),
        ("gs://bucket/model/", "gcsfs", "0.4.2"),
        ("gs://bucket/model/", "fsspec", "0.8.0"),
    ],
)
def test_a_too_old_backend_is_named_with_both_versions(tmp_path: Path, uri, name, old):
    site = fake_distribution(tmp_path / "site", name, old)
    script = f"""
import sys
sys.path.insert(0, {str(site)!r})
import weightstream
try:
    weightstream.load_weights({uri!r})
except weightstream.MissingDependencyError as error:
    assert isinstance(error, ImportError) and isinstance(error, weightstream.UnsupportedInputError)
    print(error)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    scheme = uri.split(":")[0]
    assert re.fullmatch(
        rf"{scheme}:// needs {name}>={re.escape(MINIMUM_VERSIONS[name])}; {name} {re.escape(old)} is installed: pip "
        r"install -U 'weightstream\[(s3|gcs)\]'\n",
        result.stdout,
    ), result.stdout


def test_the_floors_of_the_extras_are_the_checked_minimums():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("s3", "gcs", "test", "bench"):
        for requirement in extras[extra]:
            name, _, floor = requirement.partition(">=")
            if name in MINIMUM_VERSIONS:
                assert release(floor) == release(MINIMUM_VERSIONS[name]), (extra, requirement)


@pytest.mark.parametrize(
    ("text", "parsed"), [("2024.6.0", (2024, 6, 0)), ("1.2rc1", (1, 2)), ("0.4.2", (0, 4, 2)), ("weird", (0,))]
)
def test_release_numbers(text, parsed):
    assert release(text) == parsed
