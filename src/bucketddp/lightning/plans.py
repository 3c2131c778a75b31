"""What a Trainer checkpoint keeps of the wrapper's bucket plan, and how a wrapper adopts it.

``BucketDDP`` writes it under ``checkpoint["bucketddp"]`` and adopts it on resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_debug

from ..parallel import BucketDataParallel


def plan_entry(wrapped: BucketDataParallel) -> dict[str, Any]:
    """What a checkpoint keeps of the plan: the learned order and tuned bucket sizes."""
    entry: dict[str, Any] = {}
    if (order := wrapped.bucket_order) is not None:
        entry["bucket_order"] = order
    if (sizes := wrapped.tuned_bucket_sizes) is not None:
        entry["bucket_sizes"] = list(sizes)
    return entry


def adopt_plan(wrapped: BucketDataParallel, entry: Mapping[str, Any]) -> None:
    """Give ``wrapped`` the checkpoint's tuned bucket sizes and learned order, if any."""
    if (sizes := entry.get("bucket_sizes")) is not None and wrapped.load_bucket_sizes(*sizes):
        rank_zero_debug(f"BucketDDP: bucket sizes {sizes} from the checkpoint (no tuning)")
    if (order := entry.get("bucket_order")) is not None:
        _adopt_bucket_order(wrapped, order)


def _adopt_bucket_order(wrapped: BucketDataParallel, order: list[str]) -> None:
    if wrapped.load_bucket_order(order):
        rank_zero_debug("BucketDDP: restored the learned bucket order from the checkpoint")
    else:
        rank_zero_debug(
            "BucketDDP: the checkpoint's bucket order names other parameters than the model "
            "has; the order is learned again in the first backward pass"
        )
