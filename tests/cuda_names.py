"""Every cuda-python name weightstream uses, and the number of arguments each call passes, checked against the
cuda-bindings this interpreter imports: run as ``python -m tests.cuda_names`` (prints one problem per line, exit 1 if
any) with another release first on ``PYTHONPATH`` to check that one. Needs no GPU: the bindings import without a
driver, and their functions carry their signatures."""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "weightstream"
USES = {
    "nodecache/vmm.py": {"bindings": "driver", "driver()": "driver"},
    "memory/pinning.py": {"runtime": "runtime"},
    "memory/gds.py": {"cufile": "cufile"},
    "readers/gds.py": {"cufile": "cufile"},
    "cli/doctor.py": {"driver": "driver"},
}
"""Each module using cuda-python -> the names under which it holds each bindings module (``driver()`` in vmm.py
returns the driver module)."""


def uses(source: str, aliases: dict[str, str]) -> Iterator[tuple[str, list[str], int | None, int]]:
    """(bindings module, attribute path, positional arguments of a call or None, line) for each use in ``source``."""
    tree = ast.parse(source)
    calls = {id(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        path, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
            path.insert(0, base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in aliases:
            module = aliases[base.id]
        elif isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and f"{base.func.id}()" in aliases:
            module = aliases[f"{base.func.id}()"]
        else:
            continue
        call = calls.get(id(node))
        yield module, path, None if call is None else len(call.args), node.lineno


def problems() -> list[str]:
    """What the imported bindings lack of what weightstream uses, one line each."""
    found = []
    modules = {name: importlib.import_module(f"cuda.bindings.{name}") for name in ("driver", "runtime", "cufile")}
    seen = set()
    for relative, aliases in USES.items():
        source = (PACKAGE / relative).read_text()
        for module, path, arguments, line in uses(source, aliases):
            target: object = modules[module]
            for depth, name in enumerate(path):
                if not hasattr(target, name):
                    found.append(f"{relative}:{line}: cuda.bindings.{module}.{'.'.join(path[: depth + 1])} is missing")
                    break
                target = getattr(target, name)
            else:
                if arguments is not None and (relative, line, tuple(path)) not in seen:
                    seen.add((relative, line, tuple(path)))
                    wrong = _arity_problem(target, arguments)
                    if wrong:
                        found.append(f"{relative}:{line}: cuda.bindings.{module}.{'.'.join(path)}: {wrong}")
    return found


def _arity_problem(function: object, arguments: int) -> str | None:
    if inspect.isclass(function):
        return None  # a type's constructor (CUmemAccessDesc(), Descr()): no positional arguments are passed
    try:
        signature = inspect.signature(function)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    parameters = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in parameters if p.default is p.empty]
    if not len(required) <= arguments <= len(parameters):
        return f"called with {arguments} arguments, takes {signature}"
    return None


if __name__ == "__main__":
    import cuda.bindings

    said = problems()
    print(f"cuda-bindings {cuda.bindings.__version__}: {len(said)} problem(s)")
    print("\n".join(said))
    sys.exit(1 if said else 0)
