"""The house rules of issue 32 that a reviewer would otherwise count by hand: no function over
100 lines outside ``kernels/`` (Triton kernels may be long), no module over 600 lines in
``epd/``, ``router/`` or ``encoders/``, and only core and wire types loose at ``epd/``'s root."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 600
#: the loose modules epd/ keeps at its root: the core (the offline LLM, the engine config, the
#: prefix hash chain, the detokenizer, tensor-parallel groups) and the types that cross processes
ROOT_MODULES = {"__init__", "messages", "sampling_params", "sequence", "outputs", "errors", "multimodal",
                "structured_outputs", "block_hash", "config", "llm", "detokenizer", "distributed", "roles",
                "cluster_auth", "metrics"}


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def test_no_function_is_over_100_lines():
    long = []
    for path in _python_files("epd", "router", "encoders", "tests", "benchmarks", "examples"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "split these functions:\n" + "\n".join(long)


@pytest.mark.parametrize("folder", ["epd", "router", "encoders"])
def test_no_module_is_over_600_lines(folder):
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in _python_files(folder)
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not big, "split these modules:\n" + "\n".join(big)


def test_epd_root_holds_only_core_and_wire_types():
    loose = {p.stem for p in (ROOT / "epd").glob("*.py")} - ROOT_MODULES
    assert not loose, f"move these into a package of epd/: {sorted(loose)}"


def test_pyproject_lists_every_package():
    """A package left out of ``[tool.setuptools] packages`` is missing from a non-editable install."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in setup["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join((package, *init.parent.relative_to(ROOT / folder).parts)))
    assert found == set(setup["packages"]), {"not listed": sorted(found - set(setup["packages"])),
                                              "listed, absent": sorted(set(setup["packages"]) - found)}
