"""The checkpoint side of ``BucketDDP``: what it adds to a checkpoint, and how it reads one.

- buffers are synced by their policies before rank 0 writes the state dict;
- the learned bucket order travels under ``checkpoint["bucketddp"]``, a stateful comm
  hook's state under ``"bucketddp_comm_hook"`` (``hook_checkpoint.py``);
- a checkpoint only rank 0 can see is read there and sent to the others
  (``bucketddp.checkpoint``);
- weights saved from a wrapper (every key ``module.*``) load into the plain module;
- under ``elastic=True`` after a restart, the agreed snapshot stands for the file.

Like the other modules of ``bucketddp.lightning``, it imports Lightning.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from .._compat import weights_only_kwargs
from ..checkpoint import Source, load_checkpoint, strip_prefix
from ..faults import PROGRESS
from ..faults.progress import CHECKPOINT
from ..parallel import BucketDataParallel
from .common import CHECKPOINT_KEY
from .plans import adopt_plan, plan_entry
from .sampler_epoch import SavedLoaders

if TYPE_CHECKING:
    from .hook_checkpoint import HookCheckpoint
    from .trainer_elastic import TrainerElastic


class TrainerCheckpoints(DDPStrategy):
    """Lightning's ``DDPStrategy`` with bucketddp's checkpoint contents; ``BucketDDP``'s base.

    ``BucketDDP.__init__`` sets the attributes below.
    """

    _checkpoint_source: Source
    _hook_checkpoint: HookCheckpoint
    _elastic: TrainerElastic | None
    _saved_plan: dict[str, Any] | None
    """A loaded bucket plan, until ``configure_ddp`` wraps the model."""
    _learned_plan: dict[str, Any] | None
    """The last fit's bucket plan, for saves after it."""
    _saved_loaders: SavedLoaders
    """A loaded checkpoint's loader states, until the first epoch."""

    @property
    def _wrapped(self) -> BucketDataParallel | None:
        return self.model if isinstance(self.model, BucketDataParallel) else None

    def plan_entry(self) -> dict[str, Any]:
        """What a checkpoint keeps of the wrapper's bucket plan (order, tuned sizes)."""
        wrapped = self._wrapped
        return plan_entry(wrapped) if wrapped is not None else dict(self._learned_plan or {})

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict (no wrapper prefix), as rank 0 writes it.

        Buffers whose policy combines the ranks' values (``"mean"``, ``"sum"``...) are
        synced first: every rank takes part in checkpointing, so that sync is a collective
        like any other. ``"broadcast"`` and ``"none"`` buffers are written from rank 0's
        own values, with no collective.
        """
        if (wrapped := self._wrapped) is not None:
            wrapped.sync_buffers_to_save()
        return super().lightning_module_state_dict()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Add the bucket plan (``checkpoint["bucketddp"]``) and a stateful comm hook's
        state (``hook_checkpoint.py``: a collective), and save on rank 0."""
        self._hook_checkpoint.save(checkpoint)
        entry = self.plan_entry()
        if entry:
            checkpoint[CHECKPOINT_KEY] = entry
        with PROGRESS.during(CHECKPOINT, str(filepath)):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Read ``ckpt_path`` on every rank, or on rank 0 alone when another rank does not
        see it: the others then receive it (``checkpoint_source``, ``docs/strategy.md``).
        A copy of the training loaders' states is kept for ``on_train_start``. Under
        ``elastic=True`` after a restart, the agreed snapshot stands for the file."""
        if self._elastic is not None and self.lightning_module is not None:
            snapshot = self._elastic.take_restored(self.lightning_module.trainer)
            if snapshot is not None:
                self._saved_loaders = SavedLoaders.from_checkpoint(snapshot)
                return snapshot
        read = functools.partial(
            DDPStrategy.load_checkpoint, self, **weights_only_kwargs(weights_only)
        )
        exists = lambda path: get_filesystem(path).exists(path)  # noqa: E731
        checkpoint = load_checkpoint(
            checkpoint_path, source=self._checkpoint_source, read=read, exists=exists
        )
        self._saved_loaders = SavedLoaders.from_checkpoint(checkpoint)
        self._hook_checkpoint.loaded(checkpoint)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the weights, and the checkpoint's bucket order for the wrapper.

        Lightning loads before ``setup``, so the order is kept until ``configure_ddp`` wraps
        the model; a load into an already wrapped model adopts it at once. Weights saved
        from a wrapper (every key ``module.*``) load too.
        """
        assert self.lightning_module is not None
        keys = self.lightning_module.state_dict().keys()
        weights = strip_prefix(checkpoint["state_dict"], model_keys=keys)
        if weights is not checkpoint["state_dict"]:
            checkpoint = {**checkpoint, "state_dict": weights}
        entry = dict(checkpoint.get(CHECKPOINT_KEY) or {})
        super().load_model_state_dict(checkpoint, strict=strict)
        wrapped = self._wrapped
        if wrapped is None:
            self._saved_plan = entry
            return
        # The loaded "sum" buffers are the agreed totals from here on.
        wrapped.buffers_sync.reset_baseline()
        if entry:
            adopt_plan(wrapped, entry)
