"""The package's shape: the layer contracts (import-linter, declared in pyproject.toml), an
import graph without cycles, and generous size guards on modules, classes and test files.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import bucketddp

PACKAGE = Path(bucketddp.__file__).parent
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from dev import LINT_IMPORTS  # noqa: E402  (the command dev.py lint runs)


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, type-checking imports included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = node.module if not node.level else ".".join(filter(None, [base, node.module]))
            assert target is not None
            out |= {
                t for t in [target, *(f"{target}.{a.name}" for a in node.names)] if t in modules
            }
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
    # A module imports its parent packages on the way in: that is no cycle.
    return {t for t in out if t != name and not name.startswith(t + ".")}


def test_the_layer_contracts_hold() -> None:
    """import-linter's contracts in pyproject.toml: only ``bucketddp.lightning`` imports
    Lightning, ``import bucketddp`` loads none of it, and neither the engine nor elastic
    training imports the strategies."""
    run = subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout, run.stdout[-4000:]


def test_no_runaway_module_or_class() -> None:
    """A generous guard, not a target: the layers are what import-linter checks."""
    too_long = []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > 800:
            too_long.append(f"module {name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > 600:
                    too_long.append(f"class {name}.{node.name}: {lines} lines")
    assert not too_long, f"split these by concern: {too_long}"


def test_no_test_file_over_600_lines() -> None:
    tests = Path(__file__).resolve().parents[1]
    too_long = {
        str(p.relative_to(tests)): n
        for p in tests.rglob("test_*.py")
        if (n := p.read_text().count("\n")) > 600
    }
    assert not too_long, f"split these by concern: {too_long}"


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles = []

    def visit(name: str, path: list[str], done: set[str]) -> None:
        for target in sorted(graph[name]):
            if target in path:
                cycles.append([*path[path.index(target) :], target])
            elif target not in done:
                visit(target, [*path, target], done)
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [name], done)
    assert not cycles, cycles[:3]
