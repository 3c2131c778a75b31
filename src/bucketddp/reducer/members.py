"""The planned parameters: which of the model's are reduced, and how they are bucketed."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..buckets import BucketPlan, ParamInfo, plan_buckets


class Members:
    """The model's parameters that the reducer plans, by index into all of them.

    ``names``, ``params`` and ``index`` follow the plan's members; ``unslotted`` are the
    members whose gradients are sparse (reduced outside the buckets); ``outside`` are the
    model's parameters left out (frozen when they were planned).
    """

    def __init__(
        self,
        all_named: Sequence[tuple[str, nn.Parameter]],
        indices: list[int],
        sparse_names: frozenset[str],
    ) -> None:
        self.indices = indices
        inside = set(indices)
        self.outside = [j for j in range(len(all_named)) if j not in inside]
        self.names = [all_named[j][0] for j in indices]
        self.params = [all_named[j][1] for j in indices]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.sparse_names = sparse_names
        self.unslotted = frozenset(i for i, n in enumerate(self.names) if n in sparse_names)

    def plan(
        self, cap_bytes: int, first_cap_bytes: int, order: Sequence[str] | None = None
    ) -> BucketPlan:
        """Plan the buckets of the slotted members, in ``order`` if given."""
        infos = [
            ParamInfo(n, p.numel(), p.dtype, p.device)
            for i, (n, p) in enumerate(zip(self.names, self.params, strict=True))
            if i not in self.unslotted
        ]
        if order is not None and self.unslotted:
            order = [n for n in order if n not in self.sparse_names]
        return plan_buckets(
            infos, cap_bytes=cap_bytes, first_cap_bytes=first_cap_bytes, order=order
        )
