"""bucketddp's Lightning strategy names, registered without ``import bucketddp``.

``Trainer(strategy="bucket_ddp")``, ``Fabric(strategy="bucket_ddp")`` and
``fabric run --strategy bucket_ddp`` need our names in Lightning's registries, and Lightning
reads no entry point for strategies. So a finder on ``sys.meta_path`` waits for each
Lightning package to be imported, and right after the package has finished executing imports
the strategy module of ours that registers the names with it: ``lightning.pytorch`` gets
``bucketddp.lightning.trainer``, ``lightning.fabric`` gets ``bucketddp.lightning.fabric``.
Waiting for the whole package, rather than its ``strategies`` subpackage, means a strategy
module never sees a half-initialized package. Once every package is served, the finder
removes itself.

The finder is installed in two ways:

- ``import bucketddp`` calls ``install()`` (through ``bucketddp.lightning.registry``);
- the wheel ships ``bucketddp-strategy-names.pth``, whose one line calls ``install()`` when
  the interpreter starts (unless ``BUCKETDDP_NO_STARTUP_HOOK`` is set to anything but ""
  or "0"), so a script that never imports bucketddp has the names as well.

This module lives outside the ``bucketddp`` package because importing it must not import
``bucketddp`` (which imports torch): at interpreter start it loads nothing beyond what the
interpreter has already loaded, and it imports nothing from Lightning.
"""

# No ``from __future__ import annotations``: that import alone would double this module's
# cost at interpreter start; the annotations below are strings instead.
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

STRATEGY_MODULES = {
    "lightning.pytorch": "bucketddp.lightning.trainer",
    "lightning.fabric": "bucketddp.lightning.fabric",
}
"""Each Lightning package, and the module of ours that registers our names with it."""


def install() -> None:
    """Register now with each Lightning package that is loaded, and later with the others."""
    waiting = set()
    for target, strategy_module in STRATEGY_MODULES.items():
        module = sys.modules.get(target)
        if module is None:
            waiting.add(target)
            continue
        spec = getattr(module, "__spec__", None)
        if not getattr(spec, "_initializing", False):
            _register(strategy_module)
        # A Lightning package still initializing is importing bucketddp itself; the names
        # are then registered when the strategy module is first imported.
    finder = next((f for f in sys.meta_path if isinstance(f, AfterLightningImport)), None)
    if finder is not None:
        finder.waiting &= waiting
    elif waiting:
        sys.meta_path.insert(0, AfterLightningImport(waiting))


def _register(strategy_module: str) -> None:
    # The strategy module registers the names at import. If it is already in sys.modules,
    # possibly half-imported because it is the module importing Lightning right now, this
    # returns at once and its own last line does the registering.
    import importlib

    try:
        importlib.import_module(strategy_module)
    except Exception as err:  # never let our registration break ``import lightning``
        import warnings

        warnings.warn(
            f"bucketddp could not register its Lightning strategies ({err!r}); "
            f"the names of {strategy_module} ('bucket_ddp', ...) are unavailable",
            RuntimeWarning,
            stacklevel=2,
        )


class AfterLightningImport:
    """A ``sys.meta_path`` finder that finds nothing itself; it wraps the loader of a
    Lightning package to register our names after it (no ``importlib.abc`` base, which
    would cost an import at interpreter start)."""

    def __init__(self, waiting: "set[str]") -> None:
        self.waiting = waiting
        """The Lightning packages not imported yet."""

    def find_spec(
        self, fullname: str, path: "Sequence[str] | None", target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        """The spec the other finders give ``fullname``, with our loader around theirs."""
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


class _RegisteringLoader:
    """Runs the real loader, puts it back on the module, then registers our strategies."""

    def __init__(self, inner: "Any", finder: AfterLightningImport) -> None:
        self._inner = inner
        self._finder = finder

    def create_module(self, spec: "ModuleSpec") -> "ModuleType | None":
        return self._inner.create_module(spec)

    def exec_module(self, module: "ModuleType") -> None:
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        self._finder.waiting.discard(module.__name__)
        if not self._finder.waiting and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        _register(STRATEGY_MODULES[module.__name__])

    def __getattr__(self, name: str) -> object:
        # Anything else a caller asks of the loader (get_resource_reader, is_package, ...).
        return getattr(self._inner, name)
