"""Which tensors of a snapshot may be copied while the next step runs, and the wait for it.

Between one optimizer step and the next, a training step's forward and backward change the
gradients and the buffers (BatchNorm's statistics), not the parameters an optimizer updates
nor the optimizer's own state. Those, most of a snapshot's bytes, are copied by the
snapshot thread while the next step computes (``snapshots.Writer``), and the optimizer waits
for that copy before it changes them: a step pre-hook on each optimizer of a hand-written
loop, ``on_before_optimizer_step`` under the Trainer (whose optimizer runs the step's
forward and backward inside ``optimizer.step``). Anything else is copied at once.

A loop that changes those tensors some other way between two optimizer steps (weights
clipped or averaged in place after ``optimizer.step()``) turns this off:
``BUCKETDDP_SNAPSHOT_OVERLAP=0``, or ``Elastic(..., overlap=False)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

ENV = "BUCKETDDP_SNAPSHOT_OVERLAP"


def enabled(overlap: bool | None = None) -> bool:
    """Whether snapshots copy the optimizers' tensors during the next step: ``overlap``,
    else ``BUCKETDDP_SNAPSHOT_OVERLAP`` (``0`` turns it off), else yes."""
    if overlap is not None:
        return overlap
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "False", "no")


def optimizers_in(values: Iterable[Any]) -> list[torch.optim.Optimizer]:
    """The torch optimizers among ``values`` (one that Fabric wrapped, unwrapped)."""
    found = []
    for value in values:
        inner = getattr(value, "optimizer", value)
        if isinstance(inner, torch.optim.Optimizer):
            found.append(inner)
    return found


def late_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> set[int]:
    """The ``data_ptr()`` of every parameter ``optimizers`` update and of every tensor of
    their state: what only their steps change."""
    late: set[int] = set()
    data_ptr = torch.Tensor.data_ptr
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            late.update(map(data_ptr, group["params"]))
        for state in optimizer.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor):
                    late.add(t.data_ptr())
    return late


def settle_before_steps(
    optimizers: Iterable[torch.optim.Optimizer], settle: Callable[[], None]
) -> list[RemovableHandle]:
    """Call ``settle`` before each step of each of ``optimizers``."""
    return [o.register_step_pre_hook(lambda *_: settle()) for o in optimizers]
