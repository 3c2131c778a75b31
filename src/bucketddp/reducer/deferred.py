"""The last bucket, staged at the end of the backward rather than gradient by gradient.

A planned parameter's gradient normally runs a Python hook: about 1.2 µs for torch to
call it, and 3-4 µs more for the reducer's bookkeeping around the copy into its slot,
where torch DDP's C++ hooks cost a fraction of that. The last bucket in plan order is the
last to be ready, at the end of the backward, so staging its gradients one by one as they
come buys no overlap. Once the plan is learned (the first synced backward, which runs with
every hook, gives the ready order), the last bucket's members lose their hooks, all but
its first to be ready, which keeps the end-of-backward callback queued where the backward
does not start at the forward's outputs, and any with a post-accumulate hook of someone
else's, which must see the slot in ``.grad`` (checked again before each forward), or
more than ``LARGEST`` elements; and only if ``FEWEST`` or more are left. At the end of
the backward the reducer reads which of them got a gradient from their ``.grad``
and stages those there. What the hooks saw and this does not: a backward that does not
start at the forward's outputs and gives gradients to hookless members only (nothing
queues its end, so they are not reduced in it, only with a later backward's), and a
member given two gradients in one backward (the first synced step, which runs with every
hook, names it).

How ``.grad`` tells: after a synced step each member's ``.grad`` is its slot
(``gradient_as_bucket_view``). None means no gradient since, and another tensor (the one
autograd made after ``zero_grad(set_to_none=True)``) means one. After a backward that
does not sync (``no_sync()``) the reducer notes each ``.grad`` and its version, so that
the next backward counts only what it changed (a backward that accumulates nothing,
``torch.autograd.grad``, changes nothing). A ``.grad`` that still is the slot
(``zero_grad(set_to_none=False)``, or no zeroing) cannot tell: a bucket's slots share one
version counter. That step counts such members as given a gradient, which averages
exactly what their ``.grad`` holds, as torch DDP does for a used parameter, and the bucket
goes back to per-gradient hooks for good, so that a parameter the graph stopped using is
named again from the next step on.

Only with ``gradient_as_bucket_view`` (the default) and without ``find_unused_parameters``,
``static_graph`` or sparse gradients, whose bookkeeping needs every gradient's hook.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Sequence

import torch

from .kept_grads import SOLE_REFS, kept_elsewhere
from .state import ReducerState
from .storage import Bucket

LARGEST = 16384
"""Elements: a larger member keeps its hook. A deferred gradient is held until the end of
the backward next to its slot, where a hook copies it and frees it at once (as torch DDP
does): deferring large gradients would raise the peak memory by their size, and their
hooks are a small part of their cost."""

FEWEST = 16
"""A last bucket with fewer members to defer keeps every hook: a few hooks save less than
the staging's fixed cost (reading each ``.grad``, two foreach calls), and its small members
would lose ``prefill``'s in-place accumulation. (A 6k-parameter MLP, 5 members, showed no
gain deferred.)"""


def defer_last(r: ReducerState) -> DeferredBucket | None:
    """``r``'s last bucket, to be staged at the end of the backward; None if it cannot be,
    or if fewer than ``FEWEST`` of its members would lose their hooks."""
    if not (
        r.communicates
        and r.observed is None
        and r.gradient_as_bucket_view
        and not r.find_unused_parameters
        and r.static is None
        and r.sparse is None
        and len(r.buckets) > 0
    ):
        return None
    deferred = DeferredBucket(r.buckets[-1], r.params)
    return deferred if len(deferred.members) >= FEWEST else None


class DeferredBucket:
    """The last bucket's members that have no hook, and how to tell which got a gradient."""

    __slots__ = ("blind", "bucket", "got", "grads", "hooks", "members", "seen")

    def __init__(self, bucket: Bucket, params: Sequence[torch.Tensor]) -> None:
        """``bucket``: the plan's last, its members hooked by the reducer alone so far.

        Its first member (in ready order) keeps its hook, and so do one of more than
        ``LARGEST`` elements and one with a hook of someone else's: that hook reads
        ``.grad``, which must be the slot by then, as with a hooked member (and with
        torch DDP).
        """
        self.bucket = bucket
        self.members: list[int] = [
            i
            for i in bucket.members[1:]
            if params[i].numel() <= LARGEST and len(params[i]._post_accumulate_grad_hooks) == 1
        ]
        # Each member's post-accumulate hooks, empty once the reducer's is removed.
        self.hooks = [params[i]._post_accumulate_grad_hooks for i in self.members]
        # A member's .grad was its slot at the end of a backward: see the module's docstring.
        self.blind = False
        # After a backward that did not sync: each member's .grad (a weak reference) and its
        # version then, or None for a .grad that was None or the slot.
        self.seen: list[tuple[weakref.ref[torch.Tensor], int] | None] | None = None
        # Counted ready in this backward, not staged yet, and their gradients.
        self.got: list[int] = []
        self.grads: list[torch.Tensor] = []

    def hooked(self) -> bool:
        """Whether someone hooked a member since (checked before each forward)."""
        return any(self.hooks)

    def stage(self, r: ReducerState) -> None:
        """Stage the members counted ready in their slots, at the end of the backward.

        Averaged as ``fill_slot`` does, in a batch: copied, then multiplied by the bucket's
        scale (the same values as ``torch.mul`` into the slot).
        """
        bucket, params = self.bucket, r.params
        fast, grads, slots, slow = self.take(r.views, r.ptrs)
        if fast and not bucket.written and kept_elsewhere(r.storage, bucket):
            slow, fast = sorted(slow + fast), []  # the bucket must move first (fill_slot)
        for i in slow:
            grad = params[i].grad
            view = r.fill_slot(i, grad)
            if grad is not view:
                params[i].grad = view
        if fast:
            bucket.written = True
            torch._foreach_copy_(slots, grads)
            if not r.launcher.averages:
                torch._foreach_mul_(slots, bucket.scale)
            del grads
            for i, view in zip(fast, slots, strict=True):
                params[i].grad = view
        bucket.pending -= len(fast) + len(slow)
        if bucket.pending == 0:
            bucket.ready_at = time.perf_counter()

    def arrivals(
        self, ready: Sequence[bool], params: Sequence[torch.Tensor], views: Sequence[torch.Tensor]
    ) -> list[int]:
        """The members not yet counted ready whose ``.grad`` says they got a gradient.

        Kept, with their gradients, for ``take``.
        """
        got, grads = self.got, self.grads
        n = len(got)
        seen = self.seen
        for k, i in enumerate(self.members):
            if ready[i]:
                continue
            grad = params[i].grad
            if grad is None:
                continue
            if seen is not None and (was := seen[k]) is not None:
                if was[0]() is grad and grad._version == was[1]:
                    continue  # as the last backward left it
            elif grad is views[i]:
                self.blind = True
            got.append(i)
            grads.append(grad)
        return got[n:]

    def take(
        self, views: Sequence[torch.Tensor], ptrs: Sequence[int]
    ) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[int]]:
        """Split the members counted ready into those whose gradient can be copied into
        its slot as it is, in one batch (indices, gradients, slots), and the others.

        The others go through ``fill_slot`` one by one, whose checks name what is wrong or
        handle the rare cases: a gradient accumulated in its slot, a slot moved by a
        conversion after wrapping or kept by the user, a gradient of another dtype or layout,
        a view, or one with a graph (``create_graph=True``).
        """
        got, grads = self.got, self.grads
        self.got, self.grads = [], []
        fast: list[int] = []
        fast_grads: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        slow: list[int] = []
        strided = torch.strided
        for i, grad in zip(got, grads, strict=True):
            view = views[i]  # referenced as SOLE_REFS counts: a list element bound to a local
            if (
                grad is view
                or sys.getrefcount(view) > SOLE_REFS
                or view.data_ptr() != ptrs[i]
                or grad.layout != strided
                or grad._base is not None
                or grad.dtype != view.dtype
                or grad.requires_grad
            ):
                slow.append(i)
            else:
                fast.append(i)
                fast_grads.append(grad)
                slots.append(view)
        return fast, fast_grads, slots, slow

    def remember(
        self, synced: bool, params: Sequence[torch.Tensor], views: Sequence[torch.Tensor]
    ) -> None:
        """At the end of a backward: note the members' ``.grad`` unless it synced."""
        self.got, self.grads = [], []  # counted in a backward that did not sync
        if synced:
            self.seen = None  # each .grad is None or the slot
            return
        seen: list[tuple[weakref.ref[torch.Tensor], int] | None] = []
        for i in self.members:
            grad = params[i].grad
            if grad is None or grad is views[i]:
                seen.append(None)
            else:
                seen.append((weakref.ref(grad), grad._version))
        self.seen = seen
