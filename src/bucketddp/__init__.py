"""bucketddp: a bucketed data-parallel gradient reducer for PyTorch and a Lightning strategy.

``import bucketddp`` never imports Lightning's trainer machinery: ``BucketDDP`` is loaded
on first access.
"""

from __future__ import annotations

from typing import Any

from .buckets import Bucket, BucketPlan
from .parallel import BucketDataParallel
from .reducer import CommStats

__version__ = "0.1.0.dev0"

__all__ = [
    "Bucket",
    "BucketDDP",
    "BucketDataParallel",
    "BucketPlan",
    "CommStats",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
]


def __getattr__(name: str) -> Any:
    if name == "BucketDDP":
        from .strategy import BucketDDP

        return BucketDDP
    if name in ("SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm"):
        from . import syncbn

        return getattr(syncbn, name)
    raise AttributeError(f"module 'bucketddp' has no attribute {name!r}")
