"""Register bucketddp's strategy names with Lightning, without importing Lightning.

``import bucketddp`` must stay cheap for plain PyTorch programs and must work where Lightning
is not installed, yet ``Trainer(strategy="bucket_ddp")`` and ``Fabric(strategy="bucket_ddp")``
must work after ``import bucketddp`` whichever package the user imports first. Each
Lightning package has its strategy module, which registers the names as it loads:
``lightning.pytorch`` has ``bucketddp.lightning.trainer``, ``lightning.fabric`` has
``bucketddp.lightning.fabric``.
For each:

- if the Lightning package is already imported, the strategy module is imported now;
- otherwise a finder on ``sys.meta_path`` waits for the package to be imported and imports
  the strategy module right after the package has finished executing; once every package
  is served, the finder removes itself. Waiting for the whole package, rather than its
  ``strategies`` subpackage, means a strategy module never sees a half-initialized package.

This module imports nothing from Lightning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

_STRATEGY_MODULES = {
    "lightning.pytorch": "bucketddp.lightning.trainer",
    "lightning.fabric": "bucketddp.lightning.fabric",
}
"""Each Lightning package, and the module of ours that registers our names with it."""


def install() -> None:
    """Register now with each Lightning package that is loaded, and later with the others."""
    waiting = set()
    for target, strategy_module in _STRATEGY_MODULES.items():
        module = sys.modules.get(target)
        if module is None:
            waiting.add(target)
            continue
        spec = getattr(module, "__spec__", None)
        if not getattr(spec, "_initializing", False):
            _register(strategy_module)
        # A Lightning package still initializing is importing bucketddp itself; the names
        # are then registered when the strategy module is first imported.
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterLightningImport)), None)
    if finder is not None:
        finder.waiting &= waiting
    elif waiting:
        sys.meta_path.insert(0, _AfterLightningImport(waiting))


def _register(strategy_module: str) -> None:
    # The strategy module registers the names at import. If it is already in sys.modules,
    # possibly half-imported because it is the module importing Lightning right now, this
    # returns at once and its own last line does the registering.
    try:
        importlib.import_module(strategy_module)
    except Exception as err:  # never let our registration break ``import lightning``
        warnings.warn(
            f"bucketddp could not register its Lightning strategies ({err!r}); "
            f"the names of {strategy_module} ('bucket_ddp', ...) are unavailable",
            RuntimeWarning,
            stacklevel=2,
        )


class _AfterLightningImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of a Lightning package to register after it."""

    def __init__(self, waiting: set[str]) -> None:
        self.waiting = waiting
        """The Lightning packages not imported yet."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self.waiting:
            return None
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RegisteringLoader(spec.loader, self)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader, puts it back on the module, then registers our strategies."""

    def __init__(self, inner: importlib.abc.Loader, finder: _AfterLightningImport) -> None:
        self._inner = inner
        self._finder = finder

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        self._finder.waiting.discard(module.__name__)
        if not self._finder.waiting and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        _register(_STRATEGY_MODULES[module.__name__])

    def __getattr__(self, name: str) -> object:
        # Anything else a caller asks of the loader (get_resource_reader, is_package, ...).
        return getattr(self._inner, name)
