"""One door to Lightning: every private Lightning name our code uses is used in
``bucketddp/lightning/internals.py`` and nowhere else.

A use is an import of a private name (or from a private module) of ``lightning``, an
attribute or ``getattr`` string naming something private that Lightning defines, or, in a
class of ours that subclasses a Lightning class, a private member of those Lightning
classes that the class overrides or reads through ``self`` or ``super()``.
"""

from __future__ import annotations

import abc
import ast
import contextlib
import functools
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import lightning
import torch

SRC = Path(__file__).resolve().parents[2] / "src"
DOOR = SRC / "bucketddp" / "lightning" / "internals.py"
DOOR_MODULE = "bucketddp.lightning.internals"

# Every private Lightning name our code uses, all of them in the door. A new one is added
# here on purpose, with its function in the door.
DOOR_NAMES = {
    "_BackwardSyncControl",
    "_ChildProcessObserver",
    "_MultiProcessingLauncher",
    "_StrategyRegistry",
    "_SubprocessScriptLauncher",
    "_backward_sync_control",
    "_call_children_scripts",
    "_checkpoint_connector",
    "_combined_loader",
    "_configure_launcher",
    "_data_fetcher",
    "_determine_ddp_device_ids",
    "_get_process_group_backend",
    "_launcher",
    "_layer_sync",
    "_mode",
    "_set_num_threads_if_needed",
    "_should_check_val_fx",
    "_setup_distributed",
    "_terminate_all",
    "_wrapping_function",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    """Private names a source defines: functions, classes, names and attributes stored."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if _private(n)}


@functools.cache
def lightning_private() -> frozenset[str]:
    """Every private name Lightning's own source defines, less torch's ``nn.Module``
    members (``_modules``, ``_parameters``...), which Lightning's modules have too."""
    root = Path(lightning.__file__).parent
    names: set[str] = set()
    for package in ("pytorch", "fabric"):
        for path in (root / package).rglob("*.py"):
            names |= _defined(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(names - set(vars(torch.nn.Module)) - set(vars(torch.nn.Module())))


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def source_uses(tree: ast.AST, ours: frozenset[str]) -> set[str]:
    """Private Lightning names a source reaches by import, or on an object not ``self``
    (a name our own code also defines does not count there: it may be ours)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning"):
            parts = (node.module or "").split(".")
            found |= {a.name for a in node.names if _private(a.name)}
            found |= {p for p in parts if _private(p)}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lightning"):
                    found |= {p for p in alias.name.split(".") if _private(p)}
        elif isinstance(node, ast.Attribute) and not _is_self(node.value):
            if _private(node.attr) and node.attr in lightning_private() and node.attr not in ours:
                found.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
            if _private(name) and name in lightning_private() and name not in ours:
                found.add(name)
    return found


def _door_uses(tree: ast.AST) -> set[str]:
    """In the door, whatever it imports, reads or defines of Lightning's private names
    (its mixins override Lightning's members without subclassing Lightning)."""
    defined = {n for n in _defined(tree) if n in lightning_private()}
    reads = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and _private(n.attr) and n.attr in lightning_private()
    }
    return source_uses(tree, frozenset()) | defined | reads


def lightning_members(cls: type) -> set[str]:
    """The private members of the Lightning classes ``cls`` inherits from."""
    names: set[str] = set()
    for base in cls.__mro__:
        if base.__module__.split(".")[0] != "lightning":
            continue
        names |= {n for n in vars(base) if _private(n) and n not in vars(abc.ABC)}
        with contextlib.suppress(OSError, TypeError):
            names |= _defined(ast.parse(textwrap.dedent(inspect.getsource(base))))
    return names


def class_uses(node: ast.ClassDef, cls: type) -> set[str]:
    """Private members of ``cls``'s Lightning bases that its body defines or reads
    through ``self``/``super()``."""
    members = lightning_members(cls)
    if not members:
        return set()
    # Members that a mixin of ours (outside the door) puts over Lightning's.
    found = {
        name
        for base in cls.__mro__
        if base.__module__.startswith("bucketddp") and base.__module__ != DOOR_MODULE
        for name in vars(base)
        if name in members
    }
    for sub in ast.walk(node):
        if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and sub.name in members:
            found.add(sub.name)
        elif isinstance(sub, ast.Attribute) and _is_self(sub.value) and sub.attr in members:
            found.add(sub.attr)
    return found


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")


def uses_by_module() -> dict[Path, set[str]]:
    """Every module of ours that uses a private Lightning name, with the names."""
    paths = sorted(SRC.rglob("*.py"))
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in paths}
    ours = frozenset(
        name for path, tree in trees.items() if path != DOOR for name in _defined(tree)
    )
    uses = {}
    for path, tree in trees.items():
        found = source_uses(tree, ours) if path != DOOR else _door_uses(tree)
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        if classes:
            module = importlib.import_module(_module_name(path))
            for node in classes:
                cls = getattr(module, node.name, None)
                if isinstance(cls, type):
                    found |= class_uses(node, cls)
        if found:
            uses[path] = found
    return uses


def test_private_lightning_names_are_used_in_the_door_only() -> None:
    uses = uses_by_module()
    elsewhere = {str(p.relative_to(SRC)): sorted(n) for p, n in uses.items() if p != DOOR}
    assert not elsewhere, (
        f"private Lightning names used outside {DOOR.name}: {elsewhere}; "
        "add a function or class for the need to the door and use that"
    )
    assert uses.get(DOOR, set()) == DOOR_NAMES


def test_the_check_finds_each_kind_of_use() -> None:
    """The checks flag an import, an attribute, a getattr string and a subclass's override
    or ``self`` read of a private Lightning member, and nothing in public code."""
    source = ast.parse(
        "from lightning.fabric.strategies.launchers.subprocess_script import "
        "_SubprocessScriptLauncher\n"
        "from lightning.fabric.utilities import _something\n"
        "import lightning.pytorch.loops._sample\n"
        "trainer._checkpoint_connector.dump_checkpoint()\n"
        "getattr(loop, '_data_fetcher')\n"
        "trainer.fit(model, ckpt_path=path)\n"
    )
    assert source_uses(source, frozenset()) == {
        "_SubprocessScriptLauncher",
        "_something",
        "_sample",
        "_checkpoint_connector",
        "_data_fetcher",
    }
    assert source_uses(source, frozenset({"_data_fetcher"})) == {
        "_SubprocessScriptLauncher",
        "_something",
        "_sample",
        "_checkpoint_connector",
    }

    from lightning.pytorch.strategies import DDPStrategy

    text = (
        "class Sub(DDPStrategy):\n"
        "    def _configure_launcher(self):\n"
        "        super()._configure_launcher()\n"
        "        return self._start_method, self.cluster_environment, self._mine\n"
    )
    namespace: dict[str, object] = {"DDPStrategy": DDPStrategy}
    exec(text, namespace)
    node = ast.parse(text).body[0]
    assert isinstance(node, ast.ClassDef)
    assert class_uses(node, namespace["Sub"]) == {"_configure_launcher", "_start_method"}  # type: ignore[arg-type]
