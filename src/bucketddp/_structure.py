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
"""

from __future__ import annotations

from typing import Any

from torch.nn.modules import module as _module

_count = [0]
_installed = False


def _bump(*_: Any) -> None:
    _count[0] += 1


def watch() -> None:
    """Start counting registrations in this process (idempotent; the hooks stay installed)."""
    global _installed
    if not _installed:
        _module.register_module_parameter_registration_hook(_bump)
        _module.register_module_module_registration_hook(_bump)
        _installed = True


def registrations() -> int:
    """How many parameter or submodule assignments the process made since :func:`watch`."""
    return _count[0]
