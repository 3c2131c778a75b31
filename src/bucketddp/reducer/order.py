"""The learned bucket order: rank 0's gradient-ready order, broadcast after the first sync.

The first plan follows reverse registration order, a guess. The reducer records the order
in which gradients become ready until the end of the first synced backward; then every
rank takes rank 0's, so that all ranks launch the same buckets in the same order. The
functions here return plans; the reducer installs them (``Reducer._adopt_learned_order``,
``Reducer.load_order``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..buckets import BucketPlan
from ..comm import global_rank
from .members import Members
from .state import ReducerState


def learned_plan(
    members: Members,
    observed: Sequence[int],
    caps: tuple[int, int],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> BucketPlan:
    """The plan for rank 0's ready order, on every rank; ``observed`` is this rank's order.

    The order spans the no_sync() passes before the first synced backward, so a parameter
    may appear in it more than once: the planner keeps first occurrences and completes the
    order with every planned parameter, so that it has the same length on every rank. It
    travels as parameter indices in one tensor.
    """
    plan = members.plan(*caps, [members.names[i] for i in observed])
    if dist.get_world_size(group) == 1:
        return plan
    full = [members.index[n] for n in plan.order]
    indices = torch.tensor(full, dtype=torch.int64, device=device)
    dist.broadcast(indices, src=global_rank(group), group=group)
    return members.plan(*caps, [members.names[i] for i in indices.tolist()])


def learned_order(r: ReducerState) -> list[str] | None:
    """The ready order ``r`` learned from the first backward, or None before it is known."""
    return list(r.plan.order) if r.plan.learned else None


def checkpoint_plan(r: ReducerState, order: Sequence[str]) -> BucketPlan | None:
    """The plan for a learned ``order`` (from a checkpoint); None if its names differ."""
    if set(order) != set(r.names) or len(order) != len(r.names):
        return None
    return r.m.plan(*r.caps, order)
