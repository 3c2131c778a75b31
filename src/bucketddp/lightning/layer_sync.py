"""``BucketSyncBatchNorm``: Lightning's SyncBatchNorm plugin with ``bucketddp.SyncBatchNorm``.

``BucketDDP`` puts it in place of Lightning's ``TorchSyncBatchNorm`` (see ``trainer.py``).
"""

from __future__ import annotations

from lightning.pytorch.plugins import LayerSync
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from typing_extensions import override

from ..syncbn import convert_sync_batchnorm, revert_sync_batchnorm, syncbn_layers

TORCH_SYNCBN_REPLACED = (
    "BucketDDP syncs BatchNorm with bucketddp.SyncBatchNorm (its BucketSyncBatchNorm plugin) "
    "in place of Lightning's TorchSyncBatchNorm, from Trainer(sync_batchnorm=True) or "
    "plugins=[TorchSyncBatchNorm()]: torch.nn.SyncBatchNorm refuses CPU tensors in training, "
    "and bucketddp's layer computes the same statistics and gradients on every backend. "
    "Pass BucketDDP(sync_batchnorm=True) to ask for it and silence this warning; a LayerSync "
    "plugin of another class is used as given."
)
"""The warning when Lightning's SyncBatchNorm plugin is replaced by ours."""


class BucketSyncBatchNorm(LayerSync):
    """Lightning's LayerSync plugin with ``bucketddp.SyncBatchNorm``: works on every backend.

    ``BucketDDP`` puts it in place of Lightning's ``TorchSyncBatchNorm`` whenever
    ``Trainer(sync_batchnorm=True)`` or ``BucketDDP(sync_batchnorm=True)`` is set; it can
    also be passed directly as ``Trainer(plugins=[BucketSyncBatchNorm()])``.
    """

    @override
    def apply(self, model: Module) -> Module:
        """Replace every BatchNorm layer in ``model`` by ``bucketddp.SyncBatchNorm``.

        Warns when the model has none: the option then does nothing.
        """
        converted = convert_sync_batchnorm(model)
        if not syncbn_layers(converted):
            rank_zero_warn(
                f"sync_batchnorm=True, but the model ({type(model).__name__}) has no BatchNorm "
                "layer, so there is nothing to synchronize. Remove sync_batchnorm=True (from "
                "BucketDDP or the Trainer), or add the BatchNorm layers before fit starts.",
                category=UserWarning,
            )
        return converted

    @override
    def revert(self, model: Module) -> Module:
        """Give every converted layer its original BatchNorm class back."""
        return revert_sync_batchnorm(model)
