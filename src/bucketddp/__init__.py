"""bucketddp: a bucketed data-parallel gradient reducer for PyTorch, and Lightning
strategies built on it for the Trainer and for Fabric.

``import bucketddp`` never imports Lightning: ``BucketDDP`` and ``BucketFabricDDP`` are
loaded on first access, and the strategy names ("bucket_ddp", ...) are registered with
Lightning as soon as Lightning itself is imported (see ``lightning/registry.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _compat  # noqa: F401  (first: it refuses an older torch)
from . import clean_exit as _clean_exit
from . import fork_guard as _fork_guard
from .buckets import Bucket, BucketPlan
from .checkpoint import broadcast_checkpoint, load_checkpoint
from .faults import RankFailedError, RankStalledError
from .lightning import registry as _registry
from .parallel import BucketDataParallel
from .reducer import CommStats

if TYPE_CHECKING:
    from .lightning.comm_monitor import CommMonitor
    from .lightning.fabric import BucketFabricDDP
    from .lightning.trainer import BucketDDP

__version__ = "0.1.0"

__all__ = [
    "Bucket",
    "BucketDDP",
    "BucketDataParallel",
    "BucketFabricDDP",
    "BucketPlan",
    "CommMonitor",
    "CommStats",
    "RankFailedError",
    "RankStalledError",
    "SyncBatchNorm",
    "broadcast_checkpoint",
    "convert_sync_batchnorm",
    "load_checkpoint",
    "revert_sync_batchnorm",
]


_LIGHTNING = {
    "BucketDDP": "trainer",
    "BucketFabricDDP": "fabric",
    "CommMonitor": "comm_monitor",
}


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING:
        try:
            module = importlib.import_module(f".lightning.{_LIGHTNING[name]}", __name__)
        except ModuleNotFoundError as err:
            if err.name is None or not err.name.startswith("lightning"):
                raise
            raise ImportError(
                f"bucketddp.{name} needs Lightning: pip install 'bucketddp[lightning]'"
            ) from err
        return getattr(module, name)
    if name in ("SyncBatchNorm", "convert_sync_batchnorm", "revert_sync_batchnorm"):
        from . import syncbn

        return getattr(syncbn, name)
    raise AttributeError(f"module 'bucketddp' has no attribute {name!r}")


_registry.install()
_clean_exit.install()
_fork_guard.install()
