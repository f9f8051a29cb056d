"""The layering of the tree, read from its import graph (every import, including those
inside functions): the engine imports nothing above it, the KV transfer layer sees the
engine only through its KV-connector interface, and the API and router never import
the workers. Each failure names the offending file:line."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import epd

#: the repository root (the folder holding ``epd/``, ``router/``, ...; ``EPD_SRC`` when set)
ROOT = Path(epd.__file__).resolve().parent.parent

#: the engine's whole interface to a KV connector: all ``epd.transfer`` may import from epd.engine
ENGINE_INTERFACE = ("epd.engine.kv_connector_base",)


@dataclass(frozen=True)
class Import:
    """One imported module: ``module`` (absolute, dotted), imported by module ``importer``
    at ``path``:``line``."""

    importer: str
    module: str
    path: Path
    line: int

    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}: imports {self.module}"


def python_files(package: str, directory: Path | None = None) -> list[tuple[Path, str]]:
    """Every ``.py`` file of ``package`` (dotted, e.g. "epd.engine", or a module such as
    "epd.engine.kv_connector_base") with its dotted module name, sorted. ``directory``:
    the package's folder (default: where it is imported from; ``epd.router`` lives in
    ``router/``)."""
    if directory is None:
        mod = importlib.import_module(package)
        if not hasattr(mod, "__path__"):
            return [(Path(mod.__file__), package)]
        directory = Path(mod.__path__[0])
    out = []
    for path in sorted(directory.rglob("*.py")):
        parts = list(path.relative_to(directory).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((path, ".".join([package, *parts])))
    return out


def imports_of(path: Path, importer: str) -> Iterator[Import]:
    """Every module ``path`` (module ``importer``) imports, at any depth of its AST
    (functions, ``if`` blocks, ``try``). ``from a import b`` yields ``a`` and ``a.b`` (``b``
    may be a submodule); relative imports are resolved against the importer's package."""
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(importer, alias.name, path, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[:len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield Import(importer, base, path, node.lineno)
            for alias in node.names:
                if alias.name != "*":
                    yield Import(importer, f"{base}.{alias.name}", path, node.lineno)


def within(module: str, package: str) -> bool:
    """Whether ``module`` is ``package`` or inside it."""
    return module == package or module.startswith(package + ".")


def violations(importers: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = (),
               directory: Path | None = None) -> list[str]:
    """file:line of every import, by a module of package ``importers``, of a module inside
    one of ``forbidden`` and not inside one of ``allowed`` (``directory``: see ``python_files``)."""
    out = []
    for path, name in python_files(importers, directory):
        for imp in imports_of(path, name):
            if any(within(imp.module, f) for f in forbidden) and not any(within(imp.module, a) for a in allowed):
                out.append(imp.where())
    return sorted(set(out))


@pytest.mark.parametrize("above", ["epd.transfer", "epd.workers", "epd.api", "epd.router"])
def test_engine_imports_nothing_above_it(above):
    assert violations("epd.engine", (above,)) == []


def test_transfer_sees_the_engine_only_through_its_interface():
    assert violations("epd.transfer", ("epd.engine",), allowed=ENGINE_INTERFACE) == []


def test_the_interface_imports_no_connector():
    assert violations("epd.engine.kv_connector_base", ("epd.transfer", "epd.workers")) == []


@pytest.mark.parametrize("importers", ["epd.api", "epd.router"])
def test_api_and_router_never_import_workers(importers):
    assert violations(importers, ("epd.workers",)) == []


def test_the_graph_reader_sees_imports_inside_functions(tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "__init__.py").write_text("")
    (sub / "mod.py").write_text("import os\n\ndef f():\n    from pkg.other import thing\n    from . import sib\n")
    found = {(i.module, i.line) for i in imports_of(sub / "mod.py", "pkg.sub.mod")}
    assert {("os", 1), ("pkg.other", 4), ("pkg.other.thing", 4), ("pkg.sub", 5), ("pkg.sub.sib", 5)} <= found
    assert violations("pkg.sub", ("pkg.other",), directory=sub) == [
        f"{sub / 'mod.py'}:4: imports pkg.other", f"{sub / 'mod.py'}:4: imports pkg.other.thing"]
