"""The format registry: registration rules, unknown formats, entry points."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import weightstream
from weightstream import registry
from weightstream.errors import LoaderRegistrationError, UnknownFormatError


class EchoLoader:
    name = "echo-test"

    def check(self, opts):
        pass

    def plan(self, store, uri, opts):
        return weightstream.open  # never called by these tests

    def iter_weights(self, store, plan, opts):
        return iter(())


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    return registry


def test_builtins_are_listed():
    assert "safetensors" in weightstream.available_loaders()
    assert isinstance(registry.loaders["safetensors"], str)  # imported only when used


def test_registry_view_is_read_only():
    with pytest.raises(TypeError):
        registry.loaders["x"] = EchoLoader  # type: ignore[index]


def test_register_and_get(clean_registry):
    weightstream.register_loader("echo-test", EchoLoader)
    assert "echo-test" in weightstream.available_loaders()
    assert isinstance(clean_registry.get_loader("echo-test"), EchoLoader)
    weightstream.register_loader("echo-test", EchoLoader)  # the same class again: a no-op


def test_register_as_decorator(clean_registry):
    @weightstream.register_loader("decorated-test")
    class Decorated(EchoLoader):
        name = "decorated-test"

    assert isinstance(clean_registry.get_loader("decorated-test"), Decorated)


def test_taken_name_raises_unless_clobber(clean_registry):
    class Other(EchoLoader):
        pass

    with pytest.raises(
        LoaderRegistrationError,
        match=r"format 'safetensors' is already registered to weightstream.loaders.safetensors:SafetensorsLoader; pass "
        r"clobber=True",
    ):
        weightstream.register_loader("safetensors", Other)
    weightstream.register_loader("safetensors", Other, clobber=True)
    assert isinstance(clean_registry.get_loader("safetensors"), Other)


@pytest.mark.parametrize(
    "name, loader, message",
    [
        ("", EchoLoader, r"loader name must be a non-empty string"),
        ("x-test", 42, r"loader 'x-test' must be a class or a 'module:Class' string, got int"),
        ("x-test", "no_colon", r"dotted path 'no_colon' must look like 'package.module:Class'"),
    ],
)
def test_bad_registrations(clean_registry, name, loader, message):
    with pytest.raises(LoaderRegistrationError, match=message):
        weightstream.register_loader(name, loader)


def test_unknown_format_lists_known_ones(tmp_path: Path):
    with pytest.raises(UnknownFormatError, match=r"unknown format 'nope'; known formats: .*safetensors"):
        weightstream.load_weights(tmp_path, format="nope")


def test_unimportable_dotted_path(clean_registry):
    weightstream.register_loader("ghost-test", "no_such_module_xyz:Loader")
    with pytest.raises(
        LoaderRegistrationError,
        match=r"format 'ghost-test': cannot import 'no_such_module_xyz'.*is the package providing",
    ):
        clean_registry.get_loader("ghost-test")


def test_not_a_loader(clean_registry):
    class Empty:
        pass

    weightstream.register_loader("empty-test", Empty)
    with pytest.raises(LoaderRegistrationError, match=r"lacks name, check\(\), plan\(\) or iter_weights\(\)"):
        clean_registry.get_loader("empty-test")


def test_entry_point_group(tmp_path: Path):
    """A third-party package registers through the entry-point group, imported only when used."""
    (tmp_path / "thirdparty_loader.py").write_text(
        textwrap.dedent("""
        import sys
        sys.modules["thirdparty_loader_imported"] = sys
        class Loader:
            name = "thirdparty"
            def check(self, opts): pass
            def plan(self, store, uri, opts): return None
            def iter_weights(self, store, plan, opts): return iter(())
    """)
    )
    dist = tmp_path / "thirdparty_loader-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-loader\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[weightstream.loaders]\nthirdparty = thirdparty_loader:Loader\n")
    script = textwrap.dedent("""
        import sys
        import weightstream
        from weightstream import registry
        assert "thirdparty" in weightstream.available_loaders()
        assert "thirdparty_loader_imported" not in sys.modules
        assert type(registry.get_loader("thirdparty")).__name__ == "Loader"
        assert "thirdparty_loader_imported" in sys.modules
        print("ok")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": str(tmp_path), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.stdout.strip() == "ok", result.stderr
