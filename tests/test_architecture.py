"""The import rules of docs/architecture.md, checked on the source: every import (lazy ones inside functions included,
``if TYPE_CHECKING:`` blocks left out) points to a lower floor, no module imports itself through others (not even
through imports for type checking only, which couple modules as much), ``formats``
imports only ``errors``, sources know no format but the registries' own manifests, engines use the public API only.
The rules are a function of the import graph, so a deliberate violation is shown to fail too."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "weightstream"

FLOORS: dict[str, int] = {
    "errors": 0,
    "progress": 0,
    "terminal": 0,
    "workers": 0,
    "generated_text": 0,
    "arguments": 1,
    "formats": 1,
    "sources": 2,
    "planning": 3,
    "memory": 4,
    "options": 4,
    "readers": 5,
    "nodecache": 5,
    "loaders": 6,
    "registry": 7,
    "checkpoint": 8,
    "options_table": 8,
    "errors_table": 1,
    "weightstream": 9,
    "save": 10,
    "engines": 11,
    "nodecache.daemon": 12,
    "bench": 13,
    "cli": 14,
}
"""Each unit's floor (a package of weightstream, a top-level module, the node cache's daemon, and ``weightstream``
itself: the public names): a unit imports units of lower floors only. docs/architecture.md says what each holds."""

FORMATS_MAY_IMPORT = {"errors", "formats"}
SOURCES_MAY_READ = {"weightstream.formats.oci", "weightstream.formats.strict_json", "weightstream.formats.index"}
"""The formats sources parse themselves: registries' manifests (OCI), the Hugging Face cache's shard index."""
ENGINES_MAY_IMPORT = (
    "weightstream.errors",
    "weightstream.options",
    "weightstream.registry",
    "weightstream.formats",
    "weightstream.save",
    "weightstream.nodecache.connection",
    "weightstream.engines",
)
"""The public API (besides ``weightstream`` itself, the package's names): its errors, options and registry, the
file formats, saving, the cache's connection (finding its daemon), and the engines' own modules."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Each module of weightstream -> the modules of weightstream it imports (with ``type_checking``, those it
    imports under ``if TYPE_CHECKING:`` too)."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: set(imported_modules(path.read_text(), set(paths), type_checking)) for name, path in paths.items()}


def imported_modules(source: str, modules: set[str], type_checking: bool = False) -> Iterable[str]:
    """The weightstream modules ``source`` imports, anywhere but under ``if TYPE_CHECKING:`` (unless
    ``type_checking``)."""

    class Imports(ast.NodeVisitor):
        def __init__(self) -> None:
            self.found: list[str] = []

        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if not type_checking and (
                (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
                or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
            ):
                for statement in node.orelse:
                    self.visit(statement)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            self.found.extend(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            assert node.level == 0, "weightstream imports absolutely"
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                self.found.append(full if full in modules else str(node.module))

    imports = Imports()
    imports.visit(ast.parse(source))
    return (name for name in imports.found if name in modules)


def unit_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "weightstream"
    if parts[1] == "nodecache" and len(parts) > 2 and parts[2] == "daemon":
        return "nodecache.daemon"
    return parts[1]


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every broken rule of ``graph``, in words."""
    found = []
    for module, imported in sorted(graph.items()):
        unit = unit_of(module)
        for target in sorted(imported):
            other = unit_of(target)
            if other != unit and FLOORS[other] >= FLOORS[unit]:
                found.append(
                    f"{module} imports {target}: {other} (floor {FLOORS[other]}) is not below {unit} "
                    f"(floor {FLOORS[unit]})"
                )
            if unit == "formats" and other not in FORMATS_MAY_IMPORT:
                found.append(f"{module} imports {target}: formats imports only errors")
            if unit == "sources" and other == "formats" and target not in SOURCES_MAY_READ:
                found.append(f"{module} imports {target}: sources know no format but registries' manifests")
            if unit == "engines" and target != "weightstream" and not target.startswith(ENGINES_MAY_IMPORT):
                found.append(f"{module} imports {target}: engines use the public API only")
    found.extend(f"import circle: {' -> '.join(circle)}" for circle in circles(graph))
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules that import each other (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1 or module in graph.get(module, ()):
                found.append([*sorted(group), min(group)])

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_every_unit_has_a_floor():
    assert {unit_of(module) for module in source_graph()} <= set(FLOORS)


def test_the_source_keeps_the_import_rules():
    assert violations(source_graph()) == []


def test_no_modules_import_each_other_even_for_type_checking():
    assert circles(source_graph(type_checking=True)) == []


def test_an_import_for_type_checking_only_counts_for_circles():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from weightstream.errors import logger\n"
    assert list(imported_modules(source, {"weightstream.errors"})) == []
    assert list(imported_modules(source, {"weightstream.errors"}, type_checking=True)) == ["weightstream.errors"]


@pytest.mark.parametrize(
    ("module", "target", "broken"),
    [
        ("weightstream.formats.safetensors", "weightstream.sources.base", "formats imports only errors"),
        ("weightstream.sources.local.file", "weightstream.formats.safetensors", "sources know no format"),
        ("weightstream.readers.parallel", "weightstream.engines.vllm", "is not below readers"),
        ("weightstream.engines.common", "weightstream.planning.discover", "engines use the public API only"),
        ("weightstream.sources.local.file", "weightstream.sources.local.mapped", "import circle"),
    ],
)
def test_a_deliberate_violation_is_caught(module, target, broken):
    graph = source_graph()
    graph[module] = {*graph[module], target}
    if broken == "import circle":
        graph[target] = {*graph[target], module}
    assert any(broken in violation for violation in violations(graph))


IMPORTED_BY_IMPORT_WEIGHTSTREAM = ["weightstream", "weightstream.errors"]
"""``import weightstream``: the package and its errors (the command line's ``--help`` needs no more, and no torch)."""
IMPORTED_BY_THE_FIRST_NAME = [
    "weightstream",
    "weightstream.checkpoint",
    "weightstream.checkpoint.calls",
    "weightstream.checkpoint.handle",
    "weightstream.checkpoint.opening",
    "weightstream.checkpoint.reading",
    "weightstream.checkpoint.reads",
    "weightstream.checkpoint.slices",
    "weightstream.errors",
    "weightstream.formats",
    "weightstream.formats.index",
    "weightstream.formats.manifest",
    "weightstream.formats.safetensors",
    "weightstream.formats.sharded_state",
    "weightstream.formats.strict_json",
    "weightstream.loaders",
    "weightstream.loaders.base",
    "weightstream.loaders.safetensors",
    "weightstream.memory",
    "weightstream.memory.devices",
    "weightstream.memory.host",
    "weightstream.memory.pinning",
    "weightstream.options",
    "weightstream.planning",
    "weightstream.planning.discover",
    "weightstream.planning.headers",
    "weightstream.planning.plan",
    "weightstream.planning.planner",
    "weightstream.planning.slices",
    "weightstream.readers",
    "weightstream.readers.destination",
    "weightstream.readers.files",
    "weightstream.readers.parallel",
    "weightstream.readers.tasks",
    "weightstream.registry",
    "weightstream.sources",
    "weightstream.sources.base",
    "weightstream.sources.hub",
    "weightstream.sources.hub.ids",
    "weightstream.sources.local",
    "weightstream.sources.local.file",
    "weightstream.sources.local.identity",
    "weightstream.sources.local.mapped",
    "weightstream.sources.local.pagecache",
    "weightstream.sources.local.raw_mapping",
    "weightstream.sources.local.regular",
    "weightstream.sources.retry",
    "weightstream.workers",
]
"""What the first public name used (``weightstream.load_weights``) imports: the API and the path of a local (or cached)
safetensors load, so that a fresh process's first load imports nothing (benchmarks/fixed_costs.py). A module added
here is a choice."""


def test_what_import_weightstream_imports():
    """The lists, and nothing from outside the standard library but torch and torch's own imports (no engine, no
    CUDA bindings, no cloud SDK, no numpy unless torch brought it)."""
    script = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "import weightstream\n"
        "imported = sorted(set(sys.modules) - before)\n"
        "import torch\n"
        "before = set(sys.modules)\n"
        "weightstream.load_weights\n"
        "print(json.dumps([imported, sorted(set(sys.modules) - before | set(imported))]))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    package, first_name = json.loads(result.stdout)
    assert [name for name in package if name.split(".")[0] == "weightstream"] == IMPORTED_BY_IMPORT_WEIGHTSTREAM
    assert {name.split(".")[0] for name in package} - {"weightstream"} <= set(sys.stdlib_module_names)
    assert [name for name in first_name if name.split(".")[0] == "weightstream"] == IMPORTED_BY_THE_FIRST_NAME
    foreign = {name.split(".")[0] for name in first_name} - {"weightstream"} - set(sys.stdlib_module_names)
    assert foreign <= {"typing_extensions"}


def test_every_error_a_user_can_meet_is_exported():
    import weightstream
    from weightstream import errors

    classes = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.WeightstreamError)
    }
    assert classes - set(weightstream.__all__) == set()
    assert all(getattr(weightstream, name) is getattr(errors, name) for name in classes)
