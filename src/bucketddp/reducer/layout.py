"""Setting a reducer up for a plan: its members, their hooks, the bucket storage.

This runs at wrapping, when parameters join the plan, and when the plan is rebuilt from
the learned order: never on the per-gradient path. The core (``core.py``) reads the state
set here.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from ..buckets import BucketPlan
from ..naming import first_names
from .agreement import AgreementRow
from .autograd import ready_hook, when_given
from .members import Members
from .requires_grad import RequiresGradWatch
from .sparse import SparseGradients
from .state import ReducerState
from .static_graph import StaticGraph
from .storage import BucketStorage

log = logging.getLogger("bucketddp.reducer")


def plan_members(r: ReducerState, indices: list[int]) -> None:
    """Have ``r`` reduce the parameters at ``indices`` (into all parameters) from now on.

    Plans them in reverse registration order, to be rebuilt from the next backward's ready
    order, and hooks each of them.
    """
    unhook(r)
    m = r.m = Members(r.all_named, indices, r.sparse_names)
    r.members, r.outside, r.names, r.params = m.indices, m.outside, m.names, m.params
    if m.outside and r.frozen_watch is None:
        r.frozen_watch = RequiresGradWatch(r)
    if r.frozen_watch is not None:
        r.frozen_watch.forget(indices)
    r.unslotted = m.unslotted
    sparse = sorted(m.unslotted)
    r.sparse = SparseGradients(sparse, m.params, r.process_group) if sparse else None
    n = len(m.params)
    r.ready = [False] * n  # got its gradient in the current backward
    r.n_ready = 0
    r.used = [False] * n  # got a gradient since the last synced backward
    r.observed = []  # the ready order, until the plan is rebuilt
    r.static = StaticGraph(r) if r.static_graph else None
    install(r, m.plan(*r.caps))
    # What each parameter's hook calls: stage its gradient in a slot, or count it (sparse,
    # reduced in place). partial (C-implemented) rather than a closure: one Python frame
    # less per parameter per step.
    r.gradient_hooks = [r.unslotted_hook if i in r.unslotted else r.autograd_hook for i in range(n)]
    hooks: list[Callable[[int, torch.Tensor], None]] = (
        r.gradient_hooks if r.static is None else [r.static.autograd_hook] * n
    )
    if r.find_unused_parameters and r.static is None:
        # A hook that fires with no gradient means unused here, as in torch DDP.
        hooks = [functools.partial(when_given, hook) for hook in hooks]
    r.hook_handles = [
        ready_hook(p, functools.partial(hook, i))
        for i, (p, hook) in enumerate(zip(m.params, hooks, strict=True))
    ]


def install(r: ReducerState, plan: BucketPlan) -> None:
    """Allocate bucket storage for ``plan`` and move any existing gradients into it."""
    r.plan = plan
    n = len(r.params)
    dtype = plan[-1].dtype if len(plan) else torch.float32
    extra = r.finite.row_slots(dtype, n) if r.finite is not None else 0
    storage = r.storage = BucketStorage(
        plan if r.communicates else BucketPlan((), (), learned=False),
        r.params,
        r.m.index,
        row_numel=AgreementRow.numel(dtype, n, len(r.all_params), r.world_size, extra),
        unslotted=sorted(r.unslotted) if r.communicates else [],
        owner=r,
    )
    r.buckets, r.views, r.ptrs, r.bucket_of = (
        storage.buckets,
        storage.views,
        storage.ptrs,
        storage.bucket_of,
    )
    storage.take_grads(r.gradient_as_bucket_view)
    r.set_scales()
    if r.buckets:
        area = r.buckets[-1].row
        assert area is not None
        r.row = AgreementRow(area, planned=n, members=r.members, reducer=r, extra=extra)
        if r.finite is not None:
            r.finite.install()
    storage.count_own_tensors()
    if r.rank == 0:
        log.debug("bucketddp plan: %s", plan.describe())


def unhook(r: ReducerState) -> None:
    """Detach the planned parameters' hooks."""
    for h in r.hook_handles:
        h.remove()
    r.hook_handles = []


def plan_joined(r: ReducerState, joined: list[int]) -> None:
    """Plan the ``joined`` parameters (trainable on every rank now) with the others."""
    plan_members(r, sorted(r.members + joined))
    log.info(
        "bucketddp: %d parameter(s) now require a gradient on every rank and join the buckets: %s",
        len(joined),
        first_names([r.all_names[j] for j in joined]),
    )
