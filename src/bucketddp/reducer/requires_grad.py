"""``requires_grad`` changes after wrapping: parameters frozen at wrapping that train later.

The plan holds the parameters that required a gradient when the model was wrapped. One
outside the plan that a rank unfreezes (a backbone, by ``BackboneFinetuning``) is hooked
before the next forward, only so that the backward reaches its end-of-backward callback.
There the agreement row tells whether every rank unfroze it: then it joins the plan, and
its gradient for this step, which has no slot yet, is averaged in one extra all-reduce.
"""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

from ..comm import all_reduce_coalesced
from . import errors
from .state import ReducerState


class RequiresGradWatch:
    """Hooks the parameters outside the plan that a rank made trainable."""

    def __init__(self, reducer: ReducerState) -> None:
        self._r = reducer
        self._handles: dict[int, RemovableHandle] = {}
        self.trainable = False
        """Whether a parameter outside the plan required a gradient at the last forward."""

    def before_forward(self) -> None:
        """Hook the parameters outside the plan that now require a gradient.

        One attribute read per parameter outside the plan.
        """
        r = self._r
        trainable = False
        for j in r.outside:
            p = r.all_params[j]
            if p.requires_grad:
                trainable = True
                if j not in self._handles:
                    self._handles[j] = p.register_post_accumulate_grad_hook(r.outside_gradient)
        self.trainable = trainable

    def forget(self, planned: list[int]) -> None:
        """Unhook the parameters that joined the plan (it hooks them itself)."""
        self.trainable = False
        for j in planned:
            handle = self._handles.pop(j, None)
            if handle is not None:
                handle.remove()

    def remove(self) -> None:
        """Detach every hook."""
        for handle in self._handles.values():
            handle.remove()
        self._handles = {}


def reduce_joined(r: ReducerState, joined: list[int], contribute: bool = True) -> str | None:
    """Average the gradients of parameters that just became trainable on every rank.

    They have no bucket slot yet, so they travel in one extra all-reduce per dtype, each
    with two more elements: the ranks that produced a gradient for it, and the ranks still
    training that did not. A parameter no rank produced a gradient for keeps ``.grad``
    untouched. A rank that has joined (uneven inputs) takes part with ``contribute=False``:
    zeros, no gradient, and its own ``.grad`` left alone. Returns the error to raise.
    """
    sparse = [r.all_names[j] for j in joined if r.all_names[j] in r.sparse_names]
    if sparse:
        return errors.sparse_joined(sparse)
    params = [r.all_params[j] for j in joined]
    grads = [p.grad if contribute else None for p in params]
    averages = [
        torch.mul(g, 1.0 / r.divisor) if g is not None else torch.zeros_like(p)
        for p, g in zip(params, grads, strict=True)
    ]
    counts = [
        torch.tensor(
            [float(g is not None), float(contribute and g is None)],
            dtype=p.dtype,
            device=p.device,
        )
        for p, g in zip(params, grads, strict=True)
    ]
    all_reduce_coalesced([*averages, *counts], torch.distributed.ReduceOp.SUM, r.process_group)
    missing: list[str] = []
    for j, p, avg, summed in zip(joined, params, averages, counts, strict=True):
        produced, missed = summed.tolist()
        if produced == 0:
            continue
        if missed > 0 and not r.find_unused_parameters:
            missing.append(r.all_names[j])
        elif not contribute:
            continue
        elif p.grad is None:
            p.grad = avg
        else:
            p.grad.copy_(avg)
    if missing:
        return errors.missing(missing, r.unused_hint)
    return None
