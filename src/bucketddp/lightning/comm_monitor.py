"""CommMonitor: a Lightning callback that logs bucketddp's communication figures.

A strategy module (it imports Lightning); ``bucketddp.CommMonitor`` loads it on first use.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from ..parallel import BucketDataParallel
from ..telemetry import CommLog, check_every_n_steps, plan_summary


class CommMonitor(Callback):
    """Log communication figures every ``every_n_steps`` optimizer steps, to every logger.

    Under ``BucketDDP``, the medians of rank 0's last ``every_n_steps`` synced steps go
    through ``LightningModule.log_dict`` (TensorBoard, CSV, W&B, whatever the Trainer has):
    ``comm/total_ms`` (time with a collective in flight), ``comm/hidden_ms`` (the part of it
    under the backward), ``comm/exposed_wait_ms`` (the wait at the end of backward),
    ``comm/hidden_fraction``, ``comm/bytes``, ``comm/bytes_per_s``, ``comm/buckets``,
    ``comm/collectives`` and ``comm/step_ms``. The bucket plan is logged once, as
    hyperparameters, after the first synced step (once the plan follows the learned order).

    Args:
        every_n_steps: how many synced steps each logged figure averages.
        prefix: the prefix of the metric names.
    """

    def __init__(self, every_n_steps: int = 50, prefix: str = "comm/") -> None:
        super().__init__()
        check_every_n_steps(every_n_steps)
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self._log: CommLog | None = None
        self._plan_logged = False

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        wrapped = trainer.strategy.model
        if not isinstance(wrapped, BucketDataParallel):
            raise RuntimeError(
                "CommMonitor reads bucketddp's reducer: use it with strategy=BucketDDP() "
                f"(this Trainer's strategy is {type(trainer.strategy).__name__})"
            )
        self._log = CommLog(wrapped, self.every_n_steps, self.prefix)
        self._plan_logged = False

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        log = self._log
        if log is None:
            return
        figures = log.step()
        if not self._plan_logged and log.model.comm_stats.bucket_timings:
            self._plan_logged = True
            for logger in trainer.loggers:
                logger.log_hyperparams(plan_summary(log.model.bucket_plan))
        if figures is not None:
            pl_module.log_dict(figures, on_step=True, on_epoch=False, rank_zero_only=True)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log = None
