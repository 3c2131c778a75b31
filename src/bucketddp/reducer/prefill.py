"""Slots as ``.grad`` during the backward: gradients accumulate in their buckets.

A gradient that lands in a fresh ``.grad`` must be copied into its slot by a Python hook,
and reading that ``.grad`` makes a Python object for it: about 4 µs per parameter per
step, which torch DDP's C++ reducer does not pay. So at the first gradient of a synced
backward, every bucket whose parameters have no ``.grad`` yet (the common step, after
``zero_grad(set_to_none=True)``) is zeroed and its slots set as their ``.grad``: autograd
then adds each gradient into its slot itself, the hook only counts it, and the bucket is
averaged once, as it launches. Done in the backward, not before it, so that a backward
that does not accumulate (``torch.autograd.grad``) leaves ``.grad`` alone.

Only with ``gradient_as_bucket_view`` (the default), whose ``.grad`` tensors are the slots
after the step anyway. A slot is only prefilled while nobody but the reducer holds it
(``kept_grads.py``), so a ``.grad`` kept from an earlier step never changes; a frozen
parameter's ``.grad`` stays None. Not with ``find_unused_parameters``: a parameter the
graph reached without a gradient stays unused there, where a prefilled one would count as
used, with zeros.
"""

from __future__ import annotations

import sys

import torch

from .kept_grads import SOLE_REFS, kept_elsewhere
from .state import ReducerState
from .storage import Bucket

UNIT = torch.ones(())
"""The factor of a gradient copied into a prefilled bucket: it is averaged at launch."""


def prefill(r: ReducerState, first: int) -> None:
    """Zero each bucket that can take its gradients in place, and make its slots ``.grad``.

    Called at the step's ``first`` gradient, about to be staged: its slot is zeroed with
    the rest, and takes a copy.
    """
    views = r.views
    current = r.params[first]
    for bucket in r.buckets:
        params = bucket.params
        if not params or any(
            (p.grad is not None and p is not current) or not p.requires_grad for p in params
        ):
            continue  # a .grad to add to, or a frozen parameter (its .grad stays None)
        members = bucket.members
        if _kept(views, members):
            continue  # a .grad kept from an earlier step: fill_slot copies on write
        if kept_elsewhere(r.storage, bucket):
            continue  # another tensor on this memory: fill_slot moves the bucket
        bucket.grads.zero_()
        placed = []
        try:
            for i, p in zip(members, params, strict=True):
                if p is not current:
                    p.grad = views[i]
                    placed.append(p)
        except RuntimeError:
            # A parameter converted after wrapping (.double()): torch refuses the slot as
            # its .grad, and the copy in fill_slot names the conversion.
            for p in placed:
                p.grad = None
            continue
        bucket.prefilled = True


def average_prefilled(bucket: Bucket, averages: bool) -> None:
    """Average a prefilled bucket's gradients, once, before it launches."""
    bucket.prefilled = False
    if not averages:
        bucket.grads.mul_(bucket.scale)


def _kept(views: list[torch.Tensor], members: list[int]) -> bool:
    """Whether anyone but the reducer holds one of these slots' views."""
    for i in members:
        view = views[i]  # counted as SOLE_REFS counts it: a list element bound to a local
        if sys.getrefcount(view) > SOLE_REFS:
            return True
    return False
