"""The wrapper's bucket plan in a Trainer checkpoint (``bucketddp.bucket_plan``), adopted
on resume with what was adopted said in Lightning's debug log.

``BucketDDP`` writes it under ``checkpoint["bucketddp"]`` and adopts it on resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_debug

from ..bucket_plan import adopt_plan as adopt
from ..bucket_plan import plan_entry
from ..parallel import BucketDataParallel

__all__ = ["adopt_plan", "plan_entry"]


def adopt_plan(wrapped: BucketDataParallel, entry: Mapping[str, Any]) -> None:
    """Give ``wrapped`` the checkpoint's tuned bucket sizes and learned order, if any."""
    sized, ordered = adopt(wrapped, entry)
    if sized:
        rank_zero_debug(f"BucketDDP: bucket sizes {entry['bucket_sizes']} from the checkpoint")
    if "bucket_order" in entry:
        _say_order(ordered)


def _say_order(adopted: bool) -> None:
    if adopted:
        rank_zero_debug("BucketDDP: restored the learned bucket order from the checkpoint")
    else:
        rank_zero_debug(
            "BucketDDP: the checkpoint's bucket order names other parameters than the model "
            "has; the order is learned again in the first backward pass"
        )
