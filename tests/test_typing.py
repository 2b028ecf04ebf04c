"""The public API is typed: the package ships ``py.typed``, no public name's signature says ``Any``,
and a caller's code type-checks under ``mypy --strict``."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import weightstream

ROOT = Path(__file__).resolve().parent.parent


def _mentions_any(hint: object) -> bool:
    return hint is typing.Any or any(_mentions_any(argument) for argument in typing.get_args(hint))


def _public_callables() -> list[tuple[str, object]]:
    found = []
    for name in weightstream.__all__:
        value = getattr(weightstream, name)
        if inspect.isclass(value) and issubclass(value, BaseException):
            continue
        if inspect.isclass(value):
            found += [
                (f"{name}.{attribute}", member)
                for attribute, member in vars(value).items()
                if not attribute.startswith("_")
                and (inspect.isfunction(member) or isinstance(member, (property, classmethod)))
            ]
            if dataclasses.is_dataclass(value):
                found.append((name, value))
        else:
            found.append((name, value))
    return found


def test_the_package_ships_py_typed():
    assert (ROOT / "weightstream" / "py.typed").is_file()


@pytest.mark.parametrize(("name", "value"), _public_callables(), ids=lambda item: item if isinstance(item, str) else "")
def test_no_public_signature_says_any(name, value):
    target = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
    hints = typing.get_type_hints(target)
    assert "return" in hints or dataclasses.is_dataclass(target), f"{name} has no return type"
    assert [hint for hint, annotation in hints.items() if _mentions_any(annotation)] == [], f"{name} says Any"


@pytest.mark.slow
def test_a_callers_code_type_checks_strictly():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",
            "--no-incremental",
            "tests/typed_usage.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
