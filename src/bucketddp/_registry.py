"""Register BucketDDP's strategy names with Lightning, without importing Lightning.

``import bucketddp`` must stay cheap for plain PyTorch programs and must work where Lightning
is not installed, yet ``Trainer(strategy="bucket_ddp")`` must work after ``import bucketddp``
whichever of the two packages the user imports first. So:

- if ``lightning.pytorch`` is already imported, ``bucketddp.strategy`` is imported now, and
  registers the names as it loads;
- otherwise a finder on ``sys.meta_path`` waits for ``lightning.pytorch`` to be imported and
  imports ``bucketddp.strategy`` right after the package has finished executing, then
  removes itself. Waiting for the whole package, rather than ``lightning.pytorch.strategies``,
  means ``bucketddp.strategy`` never sees a half-initialized Lightning.

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

_TARGET = "lightning.pytorch"


def install() -> None:
    """Register now if Lightning is loaded, else once it is."""
    module = sys.modules.get(_TARGET)
    if module is not None:
        spec = getattr(module, "__spec__", None)
        if not getattr(spec, "_initializing", False):
            _register()
        # A Lightning still initializing is importing bucketddp itself; the names are then
        # registered when bucketddp.strategy is first imported (``bucketddp.BucketDDP``).
        return
    if not any(isinstance(f, _AfterLightningImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightningImport())


def _register() -> None:
    # bucketddp.strategy registers the names at import. If it is already in sys.modules,
    # possibly half-imported because it is the module importing Lightning right now, this
    # returns at once and its own last line does the registering.
    try:
        importlib.import_module("bucketddp.strategy")
    except Exception as err:  # never let our registration break ``import lightning``
        warnings.warn(
            f"bucketddp could not register its Lightning strategies ({err!r}); "
            "Trainer(strategy=BucketDDP()) and strategy='bucket_ddp' are unavailable",
            RuntimeWarning,
            stacklevel=2,
        )


class _AfterLightningImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``lightning.pytorch`` to register after it."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _TARGET:
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
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        _register()

    def __getattr__(self, name: str) -> object:
        # Anything else a caller asks of the loader (get_resource_reader, is_package, ...).
        return getattr(self._inner, name)
