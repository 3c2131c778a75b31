"""A wrapper's bucket plan as checkpoints and snapshots keep it: one entry, one encoding.

The plan is what a wrapper learns while it trains: the order in which gradients become
ready (``bucket_order``, parameter names) and, under ``bucket_cap_mb="auto"``, the sizes
the tuner chose (``bucket_sizes``). A Trainer checkpoint, a Fabric checkpoint and an
elastic snapshot all keep it as ``plan_entry`` makes it, under ``"bucketddp"`` in a
checkpoint, and give it back with ``adopt_plan``: a resumed wrapper neither learns the
order nor tunes the sizes again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .parallel import BucketDataParallel

KEYS = ("bucket_order", "bucket_sizes")


def plan_entry(wrapper: BucketDataParallel) -> dict[str, Any]:
    """The wrapper's plan: ``bucket_order`` once learned, ``bucket_sizes`` once tuned."""
    entry: dict[str, Any] = {}
    if (order := wrapper.bucket_order) is not None:
        entry["bucket_order"] = order
    if (sizes := wrapper.tuned_bucket_sizes) is not None:
        entry["bucket_sizes"] = list(sizes)
    return entry


def is_plan_entry(value: object) -> bool:
    """Whether ``value`` is an entry ``plan_entry`` made (a user's own key is not)."""
    return isinstance(value, Mapping) and bool(value) and set(value) <= set(KEYS)


def adopt_plan(wrapper: BucketDataParallel, entry: Mapping[str, Any]) -> tuple[bool, bool]:
    """Give ``wrapper`` the entry's sizes and order; whether each was adopted (sizes only
    under ``"auto"``; an order only if it names the wrapper's parameters)."""
    sizes = entry.get("bucket_sizes")
    order = entry.get("bucket_order")
    sized = sizes is not None and wrapper.load_bucket_sizes(*sizes)
    ordered = order is not None and wrapper.load_bucket_order(order)
    return sized, ordered
