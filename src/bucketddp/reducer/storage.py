"""Bucket storage: one flat tensor per planned bucket, and a view (slot) per parameter.

A gradient is staged in its parameter's slot; with ``gradient_as_bucket_view`` the slot
becomes the parameter's ``.grad``. The last bucket's storage has room for the agreement
row after the gradients (see ``agreement.py``).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._compat import storage_use_count, unflatten_views
from ..buckets import BucketPlan
from ..comm import wait_kept

# The attribute on each bucket's storage that names the reducer owning it (a weak
# reference): a gradient that is a view into another reducer's bucket tells that two
# wrappers reduce one parameter in the same backward.
OWNER = "_bucketddp_owner"

SMALL = 2048
"""Elements up to which a gradient is accumulated straight in its slot (``prefill.py``):
for a larger one, zeroing the slot and averaging it in place cost more than the copy they
save."""
FEWEST_SMALL = 16
"""Small parameters a bucket needs for them to be placed: with fewer, the step's fixed
cost of placing them (about 10 µs) is more than they save."""


class Bucket:
    """Runtime state of one planned bucket: its storage, members and pending count."""

    __slots__ = (
        "divisor",
        "expected",
        "grads",
        "hook_views",
        "members",
        "own_tensors",
        "params",
        "pending",
        "placed",
        "ready_at",
        "row",
        "scale",
        "small",
        "storage",
        "waited_at",
        "work",
        "written",
    )

    def __init__(
        self,
        storage: torch.Tensor,
        numel: int,
        members: list[int],
        params: list[torch.Tensor],
        extra_grads: int = 0,
    ) -> None:
        self.storage = storage
        self.grads = storage[:numel]  # what a communication hook sees
        self.row: torch.Tensor | None = storage[numel:] if storage.numel() > numel else None
        self.members = members  # indices into the reducer's planned parameters
        self.params = params
        # Gradients to wait for before launching: the members', and for the last bucket
        # those reduced outside any slot (sparse ones), launched just before it.
        self.expected = len(members) + extra_grads
        self.pending = self.expected
        # The all-reduce of the storage, or with a communication hook, the hook's future.
        self.work: dist.Work | torch.futures.Future[Any] | None = None
        # When its last gradient arrived and when the end of backward was done waiting for
        # it, in time.perf_counter() seconds (see timing.py).
        self.ready_at = 0.0
        self.waited_at = 0.0
        # How many tensors the reducer itself holds on the storage (see kept_grads.py), and
        # whether a slot of it was written in this backward yet.
        self.own_tensors = 0
        self.written = False
        # Its parameters small enough to be placed in their slots (prefill.py), and those
        # placed in this backward.
        small = [(i, p) for i, p in zip(members, params, strict=True) if p.numel() <= SMALL]
        self.small = small if len(small) >= FEWEST_SMALL else []
        self.placed: set[int] = set()
        # The averaging factors (see Reducer.set_scales).
        self.scale = self.divisor = torch.ones(())
        # The views a communication hook's GradBucket.gradients() returns, made at its first
        # call (views_for_hook).
        self.hook_views: list[torch.Tensor] | None = None

    def rebind(self, storage: torch.Tensor) -> None:
        """Hold ``storage`` (same size and contents) from now on."""
        numel = self.grads.numel()
        self.hook_views = None  # on the old storage; the caller recounts ``own_tensors``
        self.storage = storage
        self.grads = storage[:numel]
        self.row = storage[numel:] if storage.numel() > numel else None

    def views_for_hook(self) -> list[torch.Tensor]:
        """Views of the storage, one per parameter, for a hook's ``GradBucket.gradients()``.

        Made at the first call and kept, as torch DDP keeps its bucket views: a hook that
        asks every step (PowerSGD) would otherwise have them made every step, at the end of
        the backward for the last bucket. They are the reducer's own tensors on the storage
        (``own_tensors``), distinct from the slots' views, whose references tell a ``.grad``
        kept by the user; the hook gets a list of its own.
        """
        if self.hook_views is None:
            self.hook_views = slot_views(self.storage, self.params)
            self.own_tensors += len(self.hook_views)
        return list(self.hook_views)

    def drop_hook_views(self) -> None:
        """Forget the hook's views (a slot changed layout); they count as own no more."""
        if self.hook_views is not None:
            self.own_tensors -= len(self.hook_views)
            self.hook_views = None

    def wait(self) -> Any:
        """Wait for the bucket's communication; returns what a hook's future holds."""
        work = self.work
        if work is None:
            return None
        value = None
        try:
            if isinstance(work, dist.Work):
                # Kept past the wait: the step's agreement may raise, and the process exit
                # at once.
                wait_kept(work)
            else:
                value = work.wait()
        finally:
            # Cleared only now: while it waits, the watchdog sees the bucket in flight.
            self.work = None
        self.waited_at = time.perf_counter()
        return value


class BucketStorage:
    """The buckets of one plan, and where each planned parameter's slot is.

    ``views[i]`` is parameter ``i``'s slot, ``bucket_of[i]`` its bucket, and ``ptrs[i]``
    where the slot's memory started when it was made: a view whose pointer moved was
    rebound elsewhere (``.data`` set by a conversion after wrapping).
    """

    def __init__(
        self,
        plan: BucketPlan,
        params: Sequence[torch.Tensor],
        index: dict[str, int],
        *,
        row_numel: int,
        unslotted: Sequence[int],
        owner: object,
    ) -> None:
        """Allocate ``plan``'s buckets; ``unslotted`` parameters ride on the last bucket."""
        n = len(params)
        self.params = params
        self.views: list[torch.Tensor] = [torch.empty(0)] * n
        self.bucket_of: list[Bucket] = [None] * n  # type: ignore[list-item]
        self.buckets: list[Bucket] = []
        self._owner = weakref.ref(owner)
        for k, spec in enumerate(plan):
            last = k == len(plan) - 1
            storage = torch.zeros(
                spec.numel + (row_numel if last else 0), dtype=spec.dtype, device=spec.device
            )
            members = [index[name] for name in spec.names]
            bucket = Bucket(
                self._owned(storage),
                spec.numel,
                members,
                [params[i] for i in members],
                len(unslotted) if last else 0,
            )
            for i, view in zip(members, slot_views(storage, bucket.params), strict=True):
                self.views[i] = view
                self.bucket_of[i] = bucket
            self.buckets.append(bucket)
        if unslotted:
            if not self.buckets:  # only unslotted parameters: a bucket of the row alone
                device = params[unslotted[0]].device
                storage = self._owned(torch.zeros(row_numel, device=device))
                self.buckets.append(Bucket(storage, 0, [], [], len(unslotted)))
            for i in unslotted:
                self.bucket_of[i] = self.buckets[-1]
        self.ptrs = [v.data_ptr() for v in self.views]
        self.nbytes = sum(b.storage.nbytes for b in self.buckets)

    def _owned(self, storage: torch.Tensor) -> torch.Tensor:
        setattr(storage, OWNER, self._owner)
        return storage

    def take_grads(self, as_views: bool) -> None:
        """Copy the slotted parameters' existing ``.grad`` into their slots (and make them
        views there, with ``as_views``)."""
        for bucket in self.buckets:
            for i, param in zip(bucket.members, bucket.params, strict=True):
                if param.grad is not None:
                    self.views[i].copy_(param.grad)
                    if as_views:
                        param.grad = self.views[i]

    def set_scales(self, divisor: float) -> None:
        """Give each bucket its averaging factors: ``1 / divisor`` and ``divisor``.

        0-dim CPU tensors in the bucket's computation dtype: an operation reads one as the
        same scalar as a Python float, bit for bit, without wrapping a float into a tensor
        on every call.
        """
        for bucket in self.buckets:
            dtype = bucket.storage.dtype
            real = torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32
            bucket.scale = torch.tensor(1.0 / divisor, dtype=real)
            bucket.divisor = torch.tensor(divisor, dtype=real)

    def count_own_tensors(self) -> None:
        """Record how many tensors the reducer holds on each bucket's storage right now."""
        for bucket in self.buckets:
            bucket.own_tensors = tensors_on(bucket.storage)

    def reslot(self, i: int) -> torch.Tensor:
        """A new view of parameter ``i``'s slot, in the parameter's current layout."""
        bucket = self.bucket_of[i]
        offset = 0
        for j in bucket.members:
            if j == i:
                break
            offset += self.params[j].numel()
        param = self.params[i]
        bucket.drop_hook_views()  # made in the slot's old layout
        view = slot_views(bucket.storage[offset : offset + param.numel()], [param])[0]
        self.views[i] = view
        self.ptrs[i] = view.data_ptr()
        return view

    def move_bucket(self, bucket: Bucket) -> None:
        """Give ``bucket`` new storage with the same contents, and its slots new views.

        A ``.grad`` that is the old slot view (staged this step, or accumulated in place)
        follows to the new one.
        """
        storage = self._owned(bucket.storage.clone())
        bucket.rebind(storage)
        slots = slot_views(storage, bucket.params)
        for j, view in zip(bucket.members, slots, strict=True):
            param = self.params[j]
            if param.grad is self.views[j]:
                param.grad = view
            self.views[j] = view
            self.ptrs[j] = view.data_ptr()

    def staged_by_other(self, base: torch.Tensor) -> bool:
        """Whether ``base`` is the storage of another reducer in the middle of a backward."""
        ref = getattr(base, OWNER, None)
        other = ref() if ref is not None else None
        return other is not None and other is not self._owner() and other.in_backward


def tensors_on(storage: torch.Tensor) -> int:
    """How many tensors (and storage handles) share ``storage``'s memory."""
    return storage_use_count(storage.untyped_storage())


def slot_views(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat``, one per parameter in order, each shaped like its parameter.

    A parameter whose elements are dense in another order (``channels_last``, a transposed
    weight) gets a view with its own strides, as torch DDP's bucket views do. A gradient
    made a view then keeps the parameter's layout, which AccumulateGrad expects (otherwise
    it warns that the gradient layout contract is broken, and accumulates more slowly).
    """
    if all(p.is_contiguous() and p.numel() for p in params):
        # The common case, in one C++ call: the loop below costs about 4 us a parameter in
        # Python. (torch makes an empty parameter's view on memory of its own: those take
        # the loop.)
        return unflatten_views(flat, list(params))
    views, offset = [], 0
    for p in params:
        if not p.is_contiguous() and _dense(p):
            views.append(flat.as_strided(p.shape, p.stride(), flat.storage_offset() + offset))
        else:
            views.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive places, in some dim order."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True
