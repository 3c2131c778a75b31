"""``BucketDDP(elastic=True)``: the Trainer's snapshots and resume under torchrun.

``bucketddp.elastic`` does the work (shared memory, agreement, transfer); this module ties it
to the Trainer, through the strategy's hooks and one callback:

- before fit (in the launcher): the process group is set up, and the ranks agree on the
  newest snapshot of this job, if a node has one; if so, ``trainer.ckpt_path`` points
  Lightning at it, and ``BucketDDP.load_checkpoint`` hands it over: Lightning then restores
  the model, optimizers, schedulers, loops and callbacks as from a checkpoint file;
- the training loaders' samplers, and where each one resumes, are ``trainer_loaders.py``'s
  (``ElasticLoaders``);
- after each ``snapshot_every``-th optimizer step (``on_train_batch_end``, where a
  ``ModelCheckpoint(every_n_train_steps=...)`` saves; or, when a mid-epoch validation run
  follows, at its end), the checkpoint Lightning would save goes to shared memory instead,
  with each rank's RNG states and own buffers (``own_buffers``);
- the communication hook's state (PowerSGD's) goes with them: what every rank shares in
  the checkpoint, the rest with the rank's own part (``bucketddp.hook_state``);
- a resume puts those back: the generators where the loader starts the resumed epoch's
  first batch (``ElasticLoaders``), the rest at the first training step;
- a fit that ends normally (``on_train_end``) takes one more snapshot, of its end, marked
  finished, and keeps only it: a rank that dies after ``fit()`` returned makes torchrun
  restart every worker, and the restarted fit loads that state, with the loops' progress at
  their end and ``trainer.should_stop`` set, so Lightning's fit loop returns at once, with
  no training step. The snapshot goes when the node's workers have all exited cleanly
  (``bucketddp.elastic.ending``);
- a stop signal (SIGTERM, SIGUSR1: ``bucketddp.notice``) on any rank stops every rank after
  the same step, with a snapshot of it. Lightning's own SIGTERM handler is replaced for the
  fit: in Lightning 2.6 it broadcasts inside the handler, on the signalled rank alone, and
  hangs the job (Lightning issues #20806, #20825). Lightning registers its handlers just
  before its first ``strategy.barrier("run-stage")``; ``listen`` takes them over there;
- under SLURM's srun, Lightning's auto-requeue (``SLURMEnvironment(auto_requeue=True)``)
  is done here instead of by its handler: its requeue signal is a stop signal, the stop's
  snapshot goes to the disk folder (``preempt_dir``, by default one in
  ``default_root_dir``), and rank 0 runs ``scontrol requeue`` once every rank's copy is
  written (``bucketddp.elastic.slurm``). The requeued job resumes from the disk.

Like ``trainer.py``, it imports Lightning. A snapshot holds what ``trainer.save_checkpoint``
would save, made without its barrier (``internals.dump_checkpoint``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..elastic import collector, rng, room
from ..elastic.disk import ENV as PREEMPT_ENV
from ..elastic.job import NOT_UNDER_TORCHRUN, slurm_job_id, under_slurm
from ..elastic.loop import hook_parts, load_own_buffers, own_buffers, restore_hook
from ..elastic.overlap import enabled, late_tensors
from ..elastic.resume import Restored
from ..elastic.session import Session, open_session
from ..notice import NOTICE
from ..parallel import BucketDataParallel
from .internals import complete_saved_batch, dump_checkpoint, validation_follows
from .trainer_loaders import ElasticLoaders

TOKEN = "bucketddp-elastic://newest-snapshot"
"""The ``ckpt_path`` that stands for the agreed snapshot."""
HOOK_ENTRY = "bucketddp_elastic_comm_hook"
"""The snapshot's entry with the communication hook's shared state."""


class TrainerElastic:
    """What ``BucketDDP(elastic=True)`` keeps between its hooks (see the module docstring)."""

    def __init__(self, every: int, preempt_dir: str | os.PathLike[str] | None = None) -> None:
        self.every = every
        self.preempt_dir = preempt_dir
        self.session: Session | None = None
        self.restored: Restored | None = None
        self._own: Any = None  # this rank's own part, until the first training step
        # The comm hook's (shared entry, own part), until the first training step.
        self._hook: tuple[dict[str, Any], Any] | None = None
        self._last_step = -1
        self._after_validation = False  # the batch's snapshot waits for the validation run
        self._finished = False  # resumed at the end of a finished fit: no step is left
        self.feed = ElasticLoaders()  # the training loaders' side (trainer_loaders.py)

    def before_fit(self, strategy: Any, trainer: Any, user_ckpt_path: Any) -> None:
        """In the launcher: set up the group and agree on the snapshot to resume from."""
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if self.session is None:
            self.session = self._open(strategy.cluster_environment, trainer.default_root_dir)
        if self.session is None:
            rank_zero_warn(NOT_UNDER_TORCHRUN)
            return
        strategy.setup_environment()  # the group now; Lightning's setup finds it made
        if not any(isinstance(c, _Snapshots) for c in trainer.callbacks):
            trainer.callbacks.append(_Snapshots(self))
        # Before optimizers exist: the module, and two tensors per parameter for them.
        module = strategy.lightning_module
        need = room.estimate([module]) + 2 * room.estimate(module.parameters())
        self.restored = self.session.restore(need)
        self._finished = False
        self.feed.fit_starts(None if self.restored is None else self.restored.own)
        if self.restored is None:
            return
        self._finished = self.restored.finished
        self._own = self.restored.own
        self._last_step = self.restored.step
        if user_ckpt_path is not None:
            rank_zero_info(
                f"bucketddp: resuming from this job's snapshot ({self.restored.source}), "
                f"which is newer than ckpt_path={user_ckpt_path!r}"
            )
        else:
            rank_zero_info(f"bucketddp: resuming from this job's snapshot ({self.restored.source})")
            trainer.ckpt_path = TOKEN

    def _open(self, environment: Any, root_dir: str) -> Session | None:
        """The session, if this run can resume (``open_session``); under srun with
        Lightning's auto-requeue, rank 0 requeues after a stop, on its requeue signal too."""
        requeue = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        disk = self.preempt_dir
        if disk is None and requeue and under_slurm() and not os.environ.get(PREEMPT_ENV):
            disk = Path(root_dir) / f"bucketddp-preempt-{slurm_job_id()}"
        session = open_session(self.every, disk=disk, requeue=requeue)
        if session is not None and requeue:
            sig = signal.Signals(environment.requeue_signal or signal.SIGUSR1)
            if sig not in session.signals:
                session.signals.append(sig)
        return session

    def take_restored(self, trainer: Any) -> dict[str, Any] | None:
        """The agreed snapshot's checkpoint, once (``load_checkpoint``); None if none."""
        restored, self.restored = self.restored, None
        if restored is None:
            return None
        if trainer.ckpt_path == TOKEN:
            trainer.ckpt_path = None  # a later validate() or test() loads what it is told
        if restored.finished:
            trainer.should_stop = True  # with the loops at their end: no training step
        complete_saved_batch(restored.state, trainer.fit_loop)
        if (entry := restored.state.get(HOOK_ENTRY)) is not None:
            self._hook = entry, (restored.own or {}).get("hooks")
        self.feed.restored(restored.state, restored.world_size != trainer.world_size)
        return restored.state

    def process_dataloader(self, trainer: Any, dataloader: Any) -> Any:
        """Put an ``ElasticSampler`` in each training loader (``ElasticLoaders``)."""
        if self.session is None or not trainer.training:
            return dataloader
        return self.feed.process_dataloader(trainer, dataloader)

    def check_loaders(self, combined: Any) -> None:
        """At the fit's start: note the training loaders (``ElasticLoaders.check_loaders``)."""
        if self.session is not None:
            self.feed.check_loaders(combined)

    def train_started(self, trainer: Any) -> None:
        """At ``on_train_start``: listen for the stop signals; an epoch-end resume's
        generators (``ElasticLoaders.train_started``)."""
        self.listen(trainer)
        self.feed.train_started(trainer)

    def before_training_step(self, wrapped: BucketDataParallel | None) -> None:
        """After a resume, put back this rank's own buffers (and its generators, if the
        loader did not: a loader without our sampler), where the interrupted fit took
        them."""
        self._restore_own(wrapped)
        if wrapped is not None and self._hook is not None:
            restore_hook(wrapped, *self._hook)
            self._hook = None

    def after_setup(self, wrapped: BucketDataParallel | None) -> None:
        """Once the model is wrapped (``on_fit_start``): after resuming at the end of a
        finished fit, which runs no training step, put back this rank's own part now."""
        if self._finished:
            self._restore_own(wrapped)

    def _restore_own(self, wrapped: BucketDataParallel | None) -> None:
        own = self._own
        if own is None:
            return
        self.feed.restore_rng()
        if wrapped is not None:
            load_own_buffers(wrapped, own["buffers"])
            self._own = None

    def batch_ended(self, trainer: Any, wrapped: BucketDataParallel, plan: dict[str, Any]) -> None:
        """A training batch ended: ``snapshot`` now, or, when the fit loop validates next
        mid-epoch, once that run has ended (``validation_ended``); a stop signal waits for
        it too. A validation run changes the state: it draws from the random generators
        (its ``DataLoader`` iterator draws a seed), and callbacks act on its metrics. A fit
        resumed from the batch's end counts that run done and skips it, so a rank killed
        in it or in the next step would resume differently. At an epoch's end the
        snapshot stays at the batch's end, where a resumed fit starts the next epoch
        without running that epoch's end again (docs/elastic.md): the weights resumed
        bit-equal from there in the checks, and not from a post-validation state, whose
        resume made the next epoch's loader draw its seed from other generator states."""
        processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        mid_epoch = processed < trainer.num_training_batches
        self._after_validation = mid_epoch and validation_follows(trainer)
        if not self._after_validation:
            self.snapshot(trainer, wrapped, plan)

    def validation_ended(
        self, trainer: Any, wrapped: BucketDataParallel, plan: dict[str, Any]
    ) -> None:
        """A validation run of the fit ended (the strategy's ``on_validation_end``, after
        every callback's): take the snapshot that waited for it."""
        if self._after_validation:
            self._after_validation = False
            self.snapshot(trainer, wrapped, plan)

    def snapshot(self, trainer: Any, wrapped: BucketDataParallel, plan: dict[str, Any]) -> None:
        """After an optimizer step, if a snapshot is due: take it."""
        step = trainer.global_step
        session = self.session
        if session is None or not session.due(step):
            return
        if step == self._last_step:
            if NOTICE.agreed:  # the snapshot of this step is there already
                session.stop(step)
            return
        self._last_step = step
        # Copied during the next step (overlap.py), unless BUCKETDDP_SNAPSHOT_OVERLAP=0.
        with collector.held_off():
            late = late_tensors(trainer.optimizers) if enabled() else ()
            session.take(step, *self._parts(trainer, wrapped, plan), late=late)
        if NOTICE.agreed:
            session.stop(step)

    def _parts(
        self, trainer: Any, wrapped: BucketDataParallel, plan: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The checkpoint Lightning would save now, and this rank's own part."""
        checkpoint = dump_checkpoint(trainer)
        if plan:
            checkpoint["bucketddp"] = plan
        own: dict[str, Any] = {"rng": rng.capture(), "buffers": own_buffers(wrapped)}
        self.feed.add_position(trainer, checkpoint, own)
        checkpoint[HOOK_ENTRY], own["hooks"] = hook_parts(wrapped)
        return checkpoint, own

    def listen(self, trainer: Any) -> None:
        """The fit's loop starts: while fitting, the stop signals are ours (not Lightning's:
        see the module docstring). Its state now, at ``trainer.global_step``, is the one it
        started from: no snapshot until an optimizer step has moved it (with
        ``accumulate_grad_batches``, the batches before a step hold gradients that a
        snapshot does not)."""
        self._last_step = trainer.global_step
        if self.session is not None and trainer.training and not self._finished:
            self.session.listen()

    def finish(
        self, trainer: Any, wrapped: BucketDataParallel | None, plan: dict[str, Any]
    ) -> None:
        """The fit's loop ended normally (``on_train_end``): a snapshot of its end, marked
        finished, is kept until the node's workers exit cleanly (``Session.finish``)."""
        session = self.session
        if session is None or self._finished:
            return
        if wrapped is None:
            session.finish()
        else:
            session.finish(trainer.global_step, *self._parts(trainer, wrapped, plan))

    def fit_ended(self) -> None:
        """The fit returned normally (``on_fit_end``), its loop maybe skipped (resumed where
        it was done): training is over, whatever ``finish`` did."""
        if self.session is not None and not self.session.finished:
            self.session.finish()


class _Snapshots(Callback):
    """Takes the snapshots, where ``ModelCheckpoint(every_n_train_steps=...)`` saves."""

    def __init__(self, elastic: TrainerElastic) -> None:
        self.elastic = elastic

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """The stop signals are ours (again, should Lightning have registered its own);
        an epoch-end resume's generators (``TrainerElastic.train_started``)."""
        self.elastic.train_started(trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """The next epoch's generators, after a finished epoch run again
        (``ElasticLoaders.epoch_started``)."""
        self.elastic.feed.epoch_started(trainer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        """Snapshot after an optimizer step, when one is due (or after the validation run
        that follows: ``TrainerElastic.batch_ended``)."""
        strategy = trainer.strategy
        wrapped = getattr(strategy, "_wrapped", None)
        if wrapped is not None:
            self.elastic.batch_ended(trainer, wrapped, strategy.plan_entry())

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """The last snapshot's copy of the parameters and optimizer states is done before
        the optimizer changes them (after the step's forward and backward)."""
        if self.elastic.session is not None:
            self.elastic.session.settle()

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """The model is wrapped: resumed at a finished fit's end, put back each rank's own
        part (no training step will)."""
        self.elastic.after_setup(getattr(trainer.strategy, "_wrapped", None))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """A fit that ends normally keeps the snapshot of its end (``TrainerElastic.finish``)."""
        strategy = trainer.strategy
        wrapped = getattr(strategy, "_wrapped", None)
        self.elastic.finish(trainer, wrapped, strategy.plan_entry() if wrapped else {})

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Training is over (its loop may have been skipped: ``fit_ended``)."""
        self.elastic.fit_ended()
