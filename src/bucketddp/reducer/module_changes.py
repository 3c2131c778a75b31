"""Modules changed after wrapping: new Parameter objects the reducer never hooked.

A layer replaced after wrapping (``model.head = nn.Linear(...)``,
``load_state_dict(assign=True)``, the old ``weight_norm``) brings parameters whose
gradients would never be averaged: each rank would train its own. The wrapper notices the
change (see ``_structure.py``) and reports it here; every later synced backward raises on
every rank (the change travels in the agreement row) until the module is wrapped again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..naming import first_names
from . import errors


class ModuleChanges:
    """The parameters a module gained or lost since it was wrapped, and hooks on the new ones.

    A frozen parameter under a new name is no such change while it stays frozen: it gets
    no gradient, so it cannot train on a rank's own (an EMA copy of the network attached
    in ``on_fit_start``, say). It counts from the first forward at which it requires a
    gradient (``check_frozen``).
    """

    def __init__(self, on_gradient: Callable[[torch.Tensor], None]) -> None:
        self._on_gradient = on_gradient
        self.added: list[tuple[str, nn.Parameter]] = []
        self.removed: list[str] = []
        self._frozen: list[tuple[str, nn.Parameter]] = []
        self.changed: tuple[list[str], list[str]] | None = None
        self._handles: list[RemovableHandle] = []

    def update(self, added: Sequence[tuple[str, nn.Parameter]], removed: Sequence[str]) -> None:
        """The module now holds ``added`` parameters it did not hold when it was wrapped.

        ``removed`` only completes the message: a parameter that left the module gets no
        gradient, which the unused-parameter rules already cover. The added parameters are
        hooked only to make sure such a backward reaches its end-of-backward callback.
        """
        gone = set(removed)
        reported = [n for n, p in added if p.requires_grad or n in gone]
        self._frozen = [(n, p) for n, p in added if not p.requires_grad and n not in gone]
        self.added = list(added)
        self.removed = list(removed)
        self.changed = (reported, list(removed)) if reported else None
        self.remove()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_gradient)
            for _, p in added
            if p.requires_grad
        ]

    @property
    def reported(self) -> bool:
        """Whether this rank has a change to report in the agreement row."""
        return self.changed is not None

    def check_frozen(self) -> None:
        """Before a forward: an added parameter frozen so far that now trains is a change."""
        if any(p.requires_grad for _, p in self._frozen):
            self.update(self.added, self.removed)

    def remove(self) -> None:
        """Detach the hooks on the added parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []


def changed_message(changes: ModuleChanges | None, ranks: int, world_size: int) -> str:
    """The error raised on every rank when ``ranks`` ranks' modules gained parameters."""
    where = f"on {ranks} of {world_size} ranks"
    if changes is None or changes.changed is None:
        return errors.module_changed(where, "(none on this rank)")
    added, removed = changes.changed
    replaced = [n for n in added if n in removed]
    parts = [
        f"{label} {first_names(names)}"
        for label, names in (
            ("replaced", replaced),
            ("added", [n for n in added if n not in replaced]),
            ("removed", [n for n in removed if n not in replaced]),
        )
        if names
    ]
    return errors.module_changed(where, "(here: " + "; ".join(parts) + ")")
