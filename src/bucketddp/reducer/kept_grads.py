"""Copy-on-write for gradients a user kept from an earlier step.

With ``gradient_as_bucket_view`` a parameter's ``.grad`` is a view of its bucket. A user
who keeps it (``g = p.grad`` before ``zero_grad(set_to_none=True)``) would see it change
when the next step writes its gradient there, where torch DDP gives a fresh tensor after
``set_to_none``. The core checks two cheap facts per staged gradient and calls here only
when one trips: the slot's view has more references than the reducer's own, or, at a
bucket's first slot of a backward, more tensors share the bucket's memory than the
reducer holds.
"""

from __future__ import annotations

import sys

import torch

from .state import Row
from .storage import Bucket, BucketStorage, tensors_on


def copy_on_write(storage: BucketStorage, i: int) -> torch.Tensor:
    """Move the kept view of parameter ``i``'s slot to memory of its own; returns a new slot.

    The kept tensor object gets a copy of its values (one gradient's copy, as torch's fresh
    tensor costs), and the slot a new view.
    """
    kept = storage.views[i]
    kept.data = kept.clone()
    return storage.reslot(i)


def views_kept(views: list[torch.Tensor], indices: list[int]) -> bool:
    """Whether anyone but the reducer holds the slot view of one of ``indices``.

    ``fill_slot`` makes the same check inline for its one slot, on the hot path.
    """
    for i in indices:
        view = views[i]  # counted as SOLE_REFS counts it: a list element bound to a local
        if sys.getrefcount(view) > SOLE_REFS:
            return True
    return False


def kept_elsewhere(storage: BucketStorage, bucket: Bucket) -> bool:
    """Whether tensors other than the reducer's share ``bucket``'s storage.

    Slot views moved elsewhere by a conversion after wrapping (``.data`` rebound) are
    given new ones first, so that the reducer's own count is exact again.
    """
    for j in bucket.members:
        if storage.views[j].data_ptr() != storage.ptrs[j]:
            storage.reslot(j)
    return tensors_on(bucket.storage) > bucket.own_tensors


def move_bucket(storage: BucketStorage, bucket: Bucket, row: Row, i: int) -> torch.Tensor:
    """Give ``bucket`` new storage, as it is; returns parameter ``i``'s new slot.

    For other tensors on a kept ``.grad``'s memory (``p.grad.view(-1)``, ``p.grad.detach()``,
    ``p.grad.data``), which cannot be moved themselves: they keep the old storage, and the
    bucket moves on (one copy of the bucket).
    """
    storage.move_bucket(bucket)
    if bucket.row is not None:
        row.bind(bucket.row)
    # Counted once the row's views are on the new storage too: they are the reducer's own.
    bucket.own_tensors = tensors_on(bucket.storage)
    return storage.views[i]


def _sole_refs() -> int:
    """What ``sys.getrefcount`` gives in ``Reducer.fill_slot`` for a slot view held once.

    Measured the way ``fill_slot`` reads it (a list element bound to a local), so that the
    figure holds on any Python version.
    """
    held = [torch.empty(0)]
    view = held[0]
    return sys.getrefcount(view)


SOLE_REFS = _sole_refs()
"""References to a slot's view that nobody outside the reducer holds."""
