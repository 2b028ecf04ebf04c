"""The cuda-python names and call arities weightstream uses exist in both majors it supports: the installed
cuda-bindings (12.x, the test extra's), and 13.x installed beside it into a directory of the test's (skipped where the
package index cannot be reached). No GPU needed: the bindings import without a driver."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cuda_names

ROOT = Path(__file__).resolve().parents[1]


def test_the_checker_sees_every_module_and_catches_a_wrong_name_and_arity():
    counted = {
        relative: len(list(cuda_names.uses((cuda_names.PACKAGE / relative).read_text(), aliases)))
        for relative, aliases in cuda_names.USES.items()
    }
    assert all(count >= 2 for count in counted.values()), counted
    wrong = "def f():\n    bindings = driver()\n    bindings.cuMemMap(1, 2)\n    bindings.cuNoSuchCall()\n"
    found = list(cuda_names.uses(wrong, {"bindings": "driver"}))
    assert [(path, arguments) for _, path, arguments, _ in found] == [(["cuMemMap"], 2), (["cuNoSuchCall"], 0)]
    from cuda.bindings import driver

    assert (
        cuda_names._arity_problem(driver.cuMemMap, 2)
        == "called with 2 arguments, takes (ptr, size, offset, handle, flags)"
    )
    assert not hasattr(driver, "cuNoSuchCall")


def test_every_name_exists_in_the_installed_bindings():
    import cuda.bindings

    assert cuda_names.problems() == [], f"cuda-bindings {cuda.bindings.__version__}"


@pytest.mark.slow
def test_every_name_exists_in_cuda_bindings_13(tmp_path: Path):
    target = tmp_path / "cuda13"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
        + ["cuda-bindings>=13,<14", "cuda-pathfinder"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if installed.returncode != 0:
        pytest.skip(f"cuda-bindings 13 could not be installed here: {installed.stderr.strip()[-300:]}")
    checked = subprocess.run(
        [sys.executable, "-m", "tests.cuda_names"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{target}:{ROOT}"},
    )
    assert checked.stdout.startswith("cuda-bindings 13."), checked.stdout + checked.stderr
    assert checked.returncode == 0, checked.stdout
