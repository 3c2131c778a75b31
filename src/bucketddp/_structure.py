"""Notice when modules gain or lose parameters or submodules after a model was wrapped.

The reducer hooks the ``Parameter`` objects a module holds when it is wrapped. A layer
replaced afterwards (``model.head = nn.Linear(...)``, ``load_state_dict(assign=True)``,
the old ``weight_norm``) brings new ``Parameter`` objects without hooks, whose gradients
would never be averaged. Comparing every parameter before every forward costs about a
microsecond per parameter, too much for a rare mistake. Instead, torch's global
registration hooks count parameter and submodule assignments anywhere in the process, and
a wrapper compares its parameters only when that count has moved since it last looked.

Writes straight into ``module._parameters`` bypass the hooks; they are noticed at the next
assignment that goes through them.

Buffers are counted apart (:func:`buffer_version`), only on the modules of wrapped models
(:func:`track`), and only the assignments that change what a buffer sync sees: a new
buffer name, a buffer set to or from None, a tensor of another shape or dtype, or a
submodule attached (which may bring buffers). Reassigning a buffer with a tensor like the
old one (``self.n = self.n + 1``) is not counted, nor is building an unrelated module
during training.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module

_count = [0]
_buffer_count = [0]
_installed = False


def _bump(*_: Any) -> None:
    _count[0] += 1


_tracked: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _bump_buffer(module: Any, name: str, tensor: Any) -> None:
    if torch.compiler.is_compiling() or module not in _tracked:
        return
    old = module.__dict__.get("_buffers", {}).get(name)
    if old is None or tensor is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
        _buffer_count[0] += 1


def _bump_submodule(module: Any, *_: Any) -> None:
    _count[0] += 1
    # Not while torch.compile traces (a registration there is replayed, not made; and the
    # tracer cannot look into the weak set).
    if not torch.compiler.is_compiling() and module in _tracked:
        _buffer_count[0] += 1


def watch() -> None:
    """Start counting registrations in this process (idempotent; the hooks stay installed)."""
    global _installed
    if not _installed:
        _module.register_module_parameter_registration_hook(_bump)
        _module.register_module_module_registration_hook(_bump_submodule)
        _module.register_module_buffer_registration_hook(_bump_buffer)
        _installed = True


def registrations() -> int:
    """How many parameter or submodule assignments the process made since :func:`watch`."""
    return _count[0]


def buffer_version() -> int:
    """Moves whenever an assignment on a tracked module may change the buffers it holds."""
    return _buffer_count[0]


def track(modules: Iterable[nn.Module]) -> None:
    """Count buffer assignments on ``modules`` from now on (a wrapped model's, say)."""
    _tracked.update(modules)
