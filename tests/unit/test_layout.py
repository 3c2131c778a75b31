"""The package's shape: module and class sizes, and an import graph without cycles; and
the test files' sizes.

The reducer's core is meant to be read in one sitting, and features plug in around it;
these checks keep that from eroding one change at a time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import bucketddp

PACKAGE = Path(bucketddp.__file__).parent


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


def test_no_module_over_500_lines_and_no_class_over_400() -> None:
    too_long = []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > 500:
            too_long.append(f"module {name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > 400:
                    too_long.append(f"class {name}.{node.name}: {lines} lines")
    assert not too_long


def test_no_test_file_over_600_lines() -> None:
    tests = Path(__file__).resolve().parents[1]
    too_long = {
        str(p.relative_to(tests)): n
        for p in tests.rglob("test_*.py")
        if (n := p.read_text().count("\n")) > 600
    }
    assert not too_long, f"split these by concern: {too_long}"


def test_the_reducer_core_reads_in_one_sitting() -> None:
    lines = (PACKAGE / "reducer" / "core.py").read_text().count("\n")
    assert lines <= 400, f"reducer/core.py has {lines} lines"


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


def test_lightning_is_imported_only_inside_bucketddp_lightning() -> None:
    importers = set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in names):
                importers.add(name)
    # The strategies, their launchers, the Trainer's elastic part, the callback and the CLI:
    # all in bucketddp.lightning, whose __init__, registry, common and sampler_epoch modules
    # stay free of Lightning (``import bucketddp`` loads the registry).
    assert all(name.startswith("bucketddp.lightning.") for name in importers), importers
    free = {f"bucketddp.lightning.{m}" for m in ("registry", "common", "sampler_epoch")}
    assert not importers & (free | {"bucketddp.lightning"}), importers & free
    assert "bucketddp.lightning.trainer" in importers and "bucketddp.lightning.fabric" in importers
