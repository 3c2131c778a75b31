"""Where the averages go after the wait: ``.grad`` tensors, by the rules torch DDP keeps.

With ``gradient_as_bucket_view`` the ``.grad`` of a staged parameter already is its slot,
so only parameters that got no gradient here but take the average need pointing at their
slots. Without it the averages are copied into the ``.grad`` tensors. A parameter unused
on every rank, or frozen on every rank (with no gradient since the last synced backward),
keeps its ``.grad`` untouched.
"""

from __future__ import annotations

import torch

from .state import ReducerState


def take_as_planned(r: ReducerState, missing_here: list[int]) -> None:
    """Every planned parameter got a gradient on every rank: every one takes its average."""
    if r.find_unused_parameters:
        _take_used(r, [True] * len(r.params), missing_here)
    elif not r.gradient_as_bucket_view:
        _copy_back(r)


def take_agreed(
    r: ReducerState, counts: list[float], frozen: list[bool] | None, missing_here: list[int]
) -> None:
    """Take the averages by the summed row: ``counts`` per planned parameter, ``frozen``."""
    if r.find_unused_parameters:
        # A parameter frozen everywhere counts as unused everywhere: grad untouched.
        _take_used(r, [c > 0 for c in counts], missing_here)
        return
    take = None
    if frozen is not None:
        # Frozen everywhere: .grad untouched, unless some rank got a gradient for it since
        # the last synced backward (inside no_sync, before freezing it): then it takes the
        # average, as a used parameter does. A rank that has joined (uneven inputs) counts
        # in neither: it sends no gradient and no row.
        ranks = r.training_ranks
        take = [not f or c < ranks for f, c in zip(frozen, counts, strict=True)]
    if not r.gradient_as_bucket_view:
        _copy_back(r, take)
    elif take is not None:
        _take_views(r, [i for i in missing_here if take[i]])


def _take_used(r: ReducerState, used_anywhere: list[bool], missing_here: list[int]) -> None:
    """A parameter used on some rank takes the average, here too; one unused nowhere does."""
    if r.gradient_as_bucket_view:
        _take_views(r, [i for i in missing_here if used_anywhere[i]])
    else:
        _copy_back(r, used_anywhere)
    if r.sparse is not None:
        r.sparse.take_used(used_anywhere)


def _take_views(r: ReducerState, indices: list[int]) -> None:
    """Point the ``.grad`` of the slotted parameters at ``indices`` at their slots."""
    for i in indices:
        if i not in r.unslotted and r.params[i].grad is not r.views[i]:
            r.params[i].grad = r.views[i]


def _copy_back(r: ReducerState, take: list[bool] | None = None) -> None:
    """Write the averages into the ``.grad`` tensors (of the parameters ``take`` selects).

    The common step (every slotted parameter has a ``.grad`` and takes its average) is one
    ``torch._foreach_copy_`` rather than a copy per parameter.
    """
    if take is None and not r.unslotted:
        grads = [p.grad for p in r.params]
        if all(g is not None for g in grads):
            torch._foreach_copy_(grads, r.views)  # type: ignore[arg-type]
            return
    for i, p in enumerate(r.params):
        if (take is not None and not take[i]) or i in r.unslotted:
            continue
        if p.grad is None:
            p.grad = r.views[i].clone()
        else:
            p.grad.copy_(r.views[i])
