"""The package's shape: the layer contracts (import-linter, declared in pyproject.toml), an
import graph without cycles, generous size guards on modules, classes and test files, and
the reducer's state set by the reducer alone. And the repository's: nothing outside tests/
uses tests/support, and dev.py reaches every tool and benchmark.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import bucketddp

PACKAGE = Path(bucketddp.__file__).parent
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import dev  # noqa: E402
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
    pytest.importorskip("importlinter", reason="the dev extra's import-linter is not installed")
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
    """Modules under 800 lines, classes at about 400 (the standard) at most: a guard, not a
    target; the layers are what import-linter checks."""
    too_long = []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > 800:
            too_long.append(f"module {name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > 420:
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


# Outside tests/: what may not use tests/support, and what dev.py must reach.
OUTSIDE_TESTS = ("src", "tools", "benchmarks", "examples")
REACHED = ("tools", "benchmarks")
HELPERS = {
    # A script that another one runs (or a module it imports), and the command's script that
    # reaches it, which names it.
    "tools/fault_script.py": "benchmarks/fault_matrix.py",  # through tools/fault_runs.py
    "tools/names_without_import.py": "tools/check_wheel.py",
    "tools/install_page.py": "tools/check_wheel.py",
    "tools/error_exits.py": "benchmarks/error_exit_status.py",
    "benchmarks/elastic_job.py": "benchmarks/bench_elastic.py",  # through bench_elastic_restarts
}


def _code_strings(path: Path) -> list[str]:
    """The string literals of a Python file's code: docstrings and other bare strings (prose)
    left out, and comments, which are no strings."""
    tree = ast.parse(path.read_text())
    prose = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
    ]


def _uses_tests_support(text: str) -> bool:
    """Whether a string names tests/support as a path: whole, or as a path component
    ``"support"`` (``ROOT / "tests" / "support"``, ``os.path.join(..., "support")``)."""
    return re.search(r"tests[/\\]+support", text) is not None or text.strip("/\\") == "support"


def test_nothing_outside_tests_uses_tests_support() -> None:
    """tests/support is the tests' own: tools, benchmarks, examples, the package and dev.py
    neither import from it, nor put it on ``sys.path``, nor run its scripts. What they share
    with the tests is in tools/ (pytest's ``pythonpath`` lists both)."""
    files = [
        ROOT / "dev.py",
        *(p for d in OUTSIDE_TESTS for p in (ROOT / d).rglob("*") if p.is_file()),
    ]
    found = []
    for path in files:
        if path.suffix == ".py":
            strings = _code_strings(path)
        elif path.suffix in (".sh", ".ipynb", "") and "__pycache__" not in path.parts:
            strings = path.read_text(errors="replace").splitlines()
        else:
            continue
        found += [f"{path.relative_to(ROOT)}: {s!r}" for s in strings if _uses_tests_support(s)]
    assert not found, found


def _runnable(path: Path) -> bool:
    """Whether a Python file runs as a script: ``if __name__ == "__main__":`` at its top."""
    for node in ast.parse(path.read_text()).body:
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Compare) and ast.unparse(test) == "__name__ == '__main__'":
            return True
    return False


def test_dev_py_reaches_every_tool_and_benchmark() -> None:
    """Every script in tools/ and benchmarks/ is a command of dev.py (its COMMANDS, listed in
    ``python3 dev.py --help``), or a helper that such a script runs; dev.py names no file that
    is not there."""
    named = {cmd[0] for cmds in dev.COMMANDS.values() for cmd in cmds if cmd[0].endswith(".py")}
    assert not [n for n in named if not (ROOT / n).is_file()], named
    scripts = {
        str(p.relative_to(ROOT)) for d in REACHED for p in (ROOT / d).rglob("*.py") if _runnable(p)
    }
    unreached = sorted(scripts - named - HELPERS.keys())
    assert not unreached, f"give these a command in dev.py's COMMANDS: {unreached}"
    for helper, runner in HELPERS.items():
        assert runner in named, (helper, runner)
        assert Path(helper).stem in (ROOT / runner).read_text(), (helper, runner)
    unlisted = [c for c in dev.COMMANDS if f"python3 dev.py {c} " not in dev.__doc__]
    assert not unlisted, f"list these in dev.py's docstring: {unlisted}"


REDUCER_TYPES = {"ReducerState", "ReducerPlan", "Reducer"}
REDUCER_NAMES = {"r", "reducer"}  # a parameter or local holding a reducer, by convention
REDUCER_ATTRS = {"reducer", "_reducer", "_r"}  # a plug-in's or the wrapper's reducer


def _reducer_fields() -> set[str]:
    """What a reducer holds: ``ReducerState``'s declared fields and methods, and every
    attribute ``ReducerPlan`` and ``Reducer`` set on themselves."""
    fields = set()
    classes = (("state.py", "ReducerState"), ("core.py", "ReducerPlan"), ("core.py", "Reducer"))
    for module, name in classes:
        tree = ast.parse((PACKAGE / "reducer" / module).read_text())
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                fields.add(node.target.id)
            elif isinstance(node, ast.FunctionDef):
                fields.add(node.name)
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                fields |= {node.attr} if ast.unparse(node.value) == "self" else set()
    return fields


def _typed(annotation: ast.expr | None) -> bool:
    """Whether ``annotation`` names the reducer's type."""
    words = set(re.findall(r"\w+", ast.unparse(annotation))) if annotation else set()
    return bool(words & REDUCER_TYPES)


def _reducer_names(fn: ast.FunctionDef | ast.AsyncFunctionDef, attrs: set[str]) -> set[str]:
    """The names that hold a reducer in ``fn``: by convention, by annotation, or by alias."""
    args = fn.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    names = REDUCER_NAMES | {a.arg for a in every if a is not None and _typed(a.annotation)}
    for node in ast.walk(fn):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if _typed(node.annotation):
                names.add(node.target.id)
        elif isinstance(node, ast.Assign) and _holds_reducer(node.value, names, attrs):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _holds_reducer(node: ast.expr, names: set[str], attrs: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Attribute) and node.attr in attrs


def _state_writes(tree: ast.Module, fields: set[str]) -> Iterator[tuple[int, str]]:
    """(line, ``base.field``) for each reducer field that ``tree`` rebinds or deletes:
    assigned (tuple targets and ``+=`` included), deleted, or set with ``setattr``."""
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    attrs = set(REDUCER_ATTRS)  # attributes that hold a reducer: declared, or set from one
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and _typed(node.annotation):
            target = node.target
            attrs.add(target.attr if isinstance(target, ast.Attribute) else ast.unparse(target))
    for fn in functions:
        names = _reducer_names(fn, attrs)
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and _holds_reducer(node.value, names, attrs):
                attrs |= {t.attr for t in node.targets if isinstance(t, ast.Attribute)}
    seen = set()
    for scope, names in [
        (tree, REDUCER_NAMES),
        *((f, _reducer_names(f, attrs)) for f in functions),
    ]:
        for node in ast.walk(scope):
            base, field = None, None
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
                base, field = node.value, node.attr
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr":
                base, name = node.args[0], node.args[1]
                field = name.value if isinstance(name, ast.Constant) else None
            if base is None or field not in fields or not _holds_reducer(base, names, attrs):
                continue
            if (node.lineno, node.col_offset) not in seen:
                seen.add((node.lineno, node.col_offset))
                yield node.lineno, f"{ast.unparse(base)}.{field}"


def test_only_the_reducer_sets_its_state() -> None:
    """Every field of the reducer is set in ``reducer/core.py``, by the reducer itself;
    the other modules compute and return what it takes (``layout.build``, the launchers,
    the learned order), or call its methods. Mutating an object it holds is fine."""
    fields = _reducer_fields()
    assert {"plan", "storage", "launcher", "sync_enabled", "caps", "touched_elsewhere"} <= fields
    # The scan finds writes through an annotated parameter, an attribute and setattr; w is
    # no reducer.
    example = ast.parse(
        "def f(x: 'ReducerState', w):\n    x.plan, y = 1, 2\n    w.reducer.caps += 1\n"
        "    setattr(x, 'launcher', 0)\n    w.caps = 3\n"
    )
    found = sorted(w for _, w in _state_writes(example, fields))
    assert found == ["w.reducer.caps", "x.launcher", "x.plan"], found
    core = PACKAGE / "reducer" / "core.py"
    writes = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {write}"
        for path in sorted(_modules().values())
        if path != core
        for line, write in sorted(_state_writes(ast.parse(path.read_text()), fields))
    ]
    assert not writes, "set these in a Reducer method (core.py) instead:\n" + "\n".join(writes)
