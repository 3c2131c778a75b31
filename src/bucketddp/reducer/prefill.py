"""Small gradients accumulated straight into their slots, with no copy.

A gradient that lands in a fresh ``.grad`` must be copied into its slot by a Python hook,
and reading that ``.grad`` makes a Python object for it: about 3 µs per parameter per
step, which torch DDP's C++ reducer does not pay. So at the first gradient of a synced
backward, each small parameter (``storage.SMALL`` elements at most, in a bucket with
``storage.FEWEST_SMALL`` of them or more) with no ``.grad`` yet
(the common step, after ``zero_grad(set_to_none=True)``) gets its zeroed slot as
``.grad``: autograd then adds the gradient into the slot itself, the hook only counts it,
and the placed slots of a bucket are averaged in one call as it launches. Done in the
backward, not before it, so that a backward that does not accumulate
(``torch.autograd.grad``) leaves ``.grad`` alone. Larger gradients are copied as before:
for them, zeroing the slot and a second pass over it cost more than the copy saves.

Only with ``gradient_as_bucket_view`` (the default), whose ``.grad`` tensors are the slots
after the step anyway. A slot is only placed while nobody but the reducer holds it
(``kept_grads.py``), so a ``.grad`` kept from an earlier step never changes; a frozen
parameter's ``.grad`` stays None. Not with ``find_unused_parameters``: a parameter the
graph reached without a gradient stays unused there, where a placed one would count as
used, with zeros.
"""

from __future__ import annotations

import torch

from .kept_grads import kept_elsewhere, views_kept
from .state import ReducerState
from .storage import Bucket


def prefill(r: ReducerState, first: int) -> None:
    """Zero the small slots that can take their gradients in place, and make them ``.grad``.

    Called at the step's ``first`` gradient, about to be copied into its slot.
    """
    views = r.views
    current = r.params[first]
    deferred = r.deferred.bucket if r.deferred is not None else None
    for bucket in r.buckets:
        if not bucket.small or bucket is deferred:
            continue  # none to place, or staged at the end of the backward (deferred.py)
        # Not: a .grad to add to, a frozen parameter (its .grad stays None), or this one.
        placed = [
            i for i, p in bucket.small if p.grad is None and p.requires_grad and p is not current
        ]
        if not placed or views_kept(views, placed) or kept_elsewhere(r.storage, bucket):
            continue  # a .grad kept from an earlier step: fill_slot copies on write
        slots = [views[i] for i in placed]
        torch._foreach_zero_(slots)
        done = []
        try:
            for i, slot in zip(placed, slots, strict=True):
                r.params[i].grad = slot
                done.append(i)
        except RuntimeError:
            # A parameter converted after wrapping (.double()): torch refuses the slot as
            # its .grad, and the copy in fill_slot names the conversion.
            for i in done:
                r.params[i].grad = None
            continue
        bucket.placed = set(placed)


def average_placed(r: ReducerState, bucket: Bucket) -> None:
    """Average the gradients placed in ``bucket``'s slots, in one call, before it launches."""
    if not r.launcher.averages:
        torch._foreach_mul_([r.views[i] for i in bucket.placed], bucket.scale)
    bucket.placed.clear()
