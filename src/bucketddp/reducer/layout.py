"""Computing a reducer's layout for a plan: the bucket storage, the agreement row, the hooks.

The functions here build and return; they set nothing on the reducer. ``Reducer``
(``core.py``) takes what they return in two of its methods: ``_plan_members`` (the
members, their hooks) and ``_install`` (a ``Layout``). They run at wrapping, when
parameters join the plan, and when the plan is rebuilt: never on the per-gradient path.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from ..buckets import BucketPlan
from .agreement import AgreementRow
from .autograd import ready_hook, when_given
from .members import Members
from .sparse import SparseGradients
from .state import GradientHook, ReducerState
from .storage import BucketStorage

log = logging.getLogger("bucketddp.reducer")


class Layout(NamedTuple):
    """What a plan runs on: the plan, its bucket storage, and the agreement row."""

    plan: BucketPlan
    storage: BucketStorage
    row: AgreementRow | None  # on the last bucket; None without buckets (nothing to reduce)


def build(r: ReducerState, plan: BucketPlan) -> Layout:
    """Allocate bucket storage for ``plan`` (no buckets if ``r`` does not communicate) and
    the agreement row on its last bucket; ``r``'s members are those ``plan`` buckets."""
    n = len(r.params)
    dtype = plan[-1].dtype if len(plan) else torch.float32
    extra = r.finite.row_slots(dtype, n) if r.finite is not None else 0
    storage = BucketStorage(
        plan if r.communicates else BucketPlan((), (), learned=False),
        r.params,
        r.m.index,
        row_numel=AgreementRow.numel(dtype, n, len(r.all_params), r.world_size, extra),
        unslotted=sorted(r.unslotted) if r.communicates else [],
        owner=r,
    )
    row = None
    if storage.buckets:
        area = storage.buckets[-1].row
        assert area is not None
        row = AgreementRow(area, planned=n, members=r.members, reducer=r, extra=extra)
    return Layout(plan, storage, row)


def same_buckets(a: BucketPlan, b: BucketPlan) -> bool:
    """Whether plans ``a`` and ``b`` put the same parameters in the same buckets."""
    return [bucket.names for bucket in a] == [bucket.names for bucket in b]


def sparse_gradients(m: Members, group: dist.ProcessGroup | None) -> SparseGradients | None:
    """What reduces the sparse gradients of ``m``'s members, or None without any."""
    sparse = sorted(m.unslotted)
    return SparseGradients(sparse, m.params, m.names, group) if sparse else None


def hook_members(r: ReducerState) -> tuple[list[GradientHook], list[RemovableHandle]]:
    """Hook ``r``'s planned parameters; returns what each hook calls, and the handles.

    Each calls ``r``'s: stage the gradient in a slot, or count it (sparse, reduced in
    place); through the static graph's count if there is one.
    """
    n = len(r.params)
    # partial (C-implemented) rather than a closure: one Python frame less per parameter
    # per step.
    gradient_hooks: list[GradientHook] = [
        r.unslotted_hook if i in r.unslotted else r.autograd_hook for i in range(n)
    ]
    hooks: list[GradientHook] = gradient_hooks if r.static is None else [r.static.autograd_hook] * n
    if r.find_unused_parameters and r.static is None:
        # A hook that fires with no gradient means unused here, as in torch DDP.
        hooks = [functools.partial(when_given, hook) for hook in hooks]
    handles = [
        ready_hook(p, functools.partial(hook, i))
        for i, (p, hook) in enumerate(zip(r.params, hooks, strict=True))
    ]
    return gradient_hooks, handles
