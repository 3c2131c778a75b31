"""``BucketDDP(elastic=True)``: the Trainer's snapshots and resume under torchrun.

``bucketddp.elastic`` does the work (shared memory, agreement, transfer); this module ties it
to the Trainer, through the strategy's hooks and one callback:

- before fit (in the launcher): the process group is set up, and the ranks agree on the
  newest snapshot of this job, if a node has one; if so, ``trainer.ckpt_path`` points
  Lightning at it, and ``BucketDDP.load_checkpoint`` hands it over: Lightning then restores
  the model, optimizers, schedulers, loops and callbacks as from a checkpoint file;
- the training loader's ``DistributedSampler`` (the one Lightning puts in) becomes an
  ``ElasticSampler`` following its epoch, so a resumed epoch goes on with the samples no
  rank has used yet, at any world size; any other sampler is wrapped in a
  ``ReplaySampler``, which resumes an epoch at the same world size by drawing its order
  again and skipping what was used; with several training loaders, each one's
  ``ElasticSampler`` keeps its own position (``bucketddp.elastic.loaders``);
- after each ``snapshot_every``-th optimizer step (``on_train_batch_end``, where a
  ``ModelCheckpoint(every_n_train_steps=...)`` saves; or, when a mid-epoch validation run
  follows, at its end), the checkpoint Lightning would save goes to shared memory instead,
  with each rank's RNG states and own buffers (``own_buffers``);
- the communication hook's state (PowerSGD's) goes with them: what every rank shares in
  the checkpoint, the rest with the rank's own part (``bucketddp.hook_state``);
- a resume puts those back: the generators where the loader starts the resumed epoch's
  first batch (its iterator made, the batch not yet fetched, as in the fit that was
  interrupted, so an augmentation drawn in the dataset draws the same), the rest at the
  first training step;
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

import functools
import os
import signal
import warnings
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DistributedSampler

from ..elastic import collector, rng, room
from ..elastic.disk import ENV as PREEMPT_ENV
from ..elastic.job import NOT_UNDER_TORCHRUN, slurm_job_id, under_slurm
from ..elastic.loaders import FOLLOWED, TrainingLoader, TrainingLoaders, batches_left
from ..elastic.loop import hook_parts, load_own_buffers, own_buffers, restore_hook
from ..elastic.overlap import enabled, late_tensors
from ..elastic.replay import ReplaySampler
from ..elastic.resume import Restored
from ..elastic.sampler import ElasticSampler, same_order
from ..elastic.session import Session, open_session
from ..notice import NOTICE
from ..parallel import BucketDataParallel
from .internals import (
    combined_mode,
    complete_saved_batch,
    dump_checkpoint,
    validation_follows,
)

TOKEN = "bucketddp-elastic://newest-snapshot"
"""The ``ckpt_path`` that stands for the agreed snapshot."""
ENTRY = "bucketddp_elastic"
"""The checkpoint entry with the training sampler's position."""
HOOK_ENTRY = "bucketddp_elastic_comm_hook"
"""The snapshot's entry with the communication hook's shared state."""


class _FollowingSampler(ElasticSampler):
    """An ``ElasticSampler`` in place of the ``DistributedSampler`` Lightning made, taking
    the epoch Lightning gives that one."""

    def __init__(self, original: DistributedSampler) -> None:
        self._original = original
        super().__init__(original.dataset, **same_order(original))

    @property
    def epoch(self) -> int:
        """The epoch of the sampler Lightning made (``set_epoch`` sets that one too)."""
        return int(self._original.epoch)

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._original.epoch = value


def _batches_done(sampler: ElasticSampler, batch_sampler: Any) -> int:
    """The batches of a resumed epoch behind it at this world size: its whole length less
    the batches its rows left make."""
    size, drop = int(batch_sampler.batch_size), bool(batch_sampler.drop_last)
    return len(batch_sampler) - batches_left(sampler.left(), size, drop)


MANY_LOADERS = (
    "bucketddp: elastic=True resumes an epoch where it stopped for several training loaders "
    "when Lightning puts the sampler in each one and combines them in mode 'max_size_cycle' "
    "(its default), 'max_size' or 'min_size'; this fit has {n} loaders, {why}: after a "
    "restart mid-epoch, the rest of that epoch may use some rows twice and others not at all "
    "(the state is the snapshot's, and the epochs after it are whole). For an exact resume, "
    "leave each loader's sampler to Lightning (use_distributed_sampler=True, a DataLoader "
    "without a sampler of your own) and combine them in one of those modes."
)


def _nothing() -> None:
    """Nothing to do."""


def _count_done(trainer: Any, done: int) -> None:
    """Resumed at another world size: Lightning counted the epoch's batches at the old one;
    at this one, the epoch has ``done`` batches behind it, so that it ends when the rows
    left run out."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    # Saved on a batch's end, that batch is not yet counted completed: Lightning 2.5 and
    # later add it as they restart (``complete_saved_batch`` adds it for 2.4), then count
    # every batch completed as ready. Keep that gap.
    behind = progress.processed - progress.completed
    progress.ready = progress.started = progress.processed = done
    progress.completed = done - behind


def _first_of(loaders: list[dict[str, Any]]) -> dict[str, Any]:
    """The first loader's position and count, as a snapshot of one loader keeps them."""
    return {"position": loaders[0]["position"], "used": loaders[0]["used"]}


def _fixed_batches(batch_sampler: Any) -> bool:
    """Whether ``batch_sampler`` is torch's (or torchdata's) ``BatchSampler``: batches of
    ``batch_size`` consecutive indices of its sampler, so that ``k`` batches used are
    ``k * batch_size`` indices (a batch sampler of your own may group them otherwise)."""
    return type(batch_sampler).__name__ == "BatchSampler" and type(batch_sampler).__module__ in (
        "torch.utils.data.sampler",
        "torchdata.stateful_dataloader.sampler",
    )


def _quiet_lightnings_resume_warning() -> None:
    """Lightning warns that a loader without a ``state_dict`` cannot resume mid-epoch; its
    sampler does that here."""
    warnings.filterwarnings(
        "ignore",
        message="You're resuming from a checkpoint that ended before the epoch ended",
        category=PossibleUserWarning,
    )


class TrainerElastic:
    """What ``BucketDDP(elastic=True)`` keeps between its hooks (see the module docstring)."""

    def __init__(self, every: int, preempt_dir: str | os.PathLike[str] | None = None) -> None:
        self.every = every
        self.preempt_dir = preempt_dir
        self.session: Session | None = None
        self.restored: Restored | None = None
        self.sampler: _FollowingSampler | None = None
        self.replay: ReplaySampler | None = None  # any other sampler, wrapped
        self.batch_size = 0
        self._own: Any = None  # this rank's own part, until the first training step
        self._position: dict[str, Any] | None = None  # the sampler's, from the snapshot
        # The comm hook's (shared entry, own part), until the first training step.
        self._hook: tuple[dict[str, Any], Any] | None = None
        self._last_step = -1
        self._after_validation = False  # the batch's snapshot waits for the validation run
        self._finished = False  # resumed at the end of a finished fit: no step is left
        self._resized = False  # resumed at another world size; the epoch's count to redo
        # Resumed from an epoch's last batch: the generators there, for a loader with
        # persistent workers, whose next epoch drew no seed in the fit that went on.
        self._epoch_end_rng: dict[str, Any] | None = None
        self._persistent = False  # the training loader keeps its worker processes
        # Resumed from an epoch's last batch: that epoch and the generators there, until the
        # training starts (``train_started``).
        self._epoch_end: tuple[int, dict[str, Any]] | None = None
        # Those generators again, for the next epoch's start, where Lightning before 2.5
        # finished that epoch again with several loaders (``epoch_started``).
        self._next_epoch: tuple[int, dict[str, Any]] | None = None
        # The fit's training loaders (several: each one's position is kept).
        self.loaders = TrainingLoaders()

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
        self._epoch_end_rng = self._epoch_end = None
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
        self._position = restored.state.get(ENTRY)
        self._resized = restored.world_size != trainer.world_size
        if (entry := restored.state.get(HOOK_ENTRY)) is not None:
            self._hook = entry, (restored.own or {}).get("hooks")
        self._resume_sampler()
        self._resume_replay()
        if self._position is not None and self._position["epoch_end"]:
            # Taken on an epoch's last batch: the fit that went on made the next epoch's
            # loader iterator (which draws a seed) after it; so does this one, from here.
            self._epoch_end_rng = (self._own or {}).get("rng")
            if self._epoch_end_rng is not None and self._position.get("epoch") is not None:
                self._epoch_end = self._position["epoch"], self._epoch_end_rng
            self._restore_own(None)
        return restored.state

    def _loader_entries(self) -> list[dict[str, Any]] | None:
        """The snapshot's position of each training loader, if it kept several; else None."""
        entries = None if self._position is None else self._position.get("loaders")
        return entries if isinstance(entries, list) and len(entries) > 1 else None

    def _resume_sampler(self, trainer: Any = None, batch_sampler: Any = None) -> None:
        if self._loader_entries() is not None:
            for index in range(len(self.loaders.loaders)):
                self._resume_loader(index, trainer)
            return
        if self._position is None or self.sampler is None or self._position["position"] is None:
            return
        position, used = self._position["position"], self._position["used"]
        self.sampler.resume(position, used)
        if self._resized and trainer is not None and batch_sampler is not None:
            self._resized = False
            done = _batches_done(self.sampler, batch_sampler)
            self.sampler.resume(position, done * self.batch_size)
            _count_done(trainer, done)

    def process_dataloader(self, trainer: Any, dataloader: Any) -> Any:
        """Put an ``ElasticSampler`` in each training loader, in place of Lightning's
        ``DistributedSampler``."""
        if self.session is None or not trainer.training:
            return dataloader
        batch_sampler: Any = getattr(dataloader, "batch_sampler", None)
        original = getattr(batch_sampler, "sampler", None)
        workers = bool(getattr(dataloader, "num_workers", 0))
        if type(original) is not DistributedSampler:
            index = self.loaders.add(TrainingLoader(None, 0, 0, workers))
            if original is not None and index == 0 and _fixed_batches(batch_sampler):
                self._persistent = bool(getattr(dataloader, "persistent_workers", False))
                self.replay = batch_sampler.sampler = ReplaySampler(original)
                self.batch_size = int(batch_sampler.batch_size)
                self._resume_replay()
            return dataloader
        sampler = _FollowingSampler(original)
        batch_sampler.sampler = sampler
        size, drop = int(batch_sampler.batch_size), bool(batch_sampler.drop_last)
        index = self.loaders.add(TrainingLoader(sampler, size, len(batch_sampler), workers, drop))
        if index > 0:
            self._resume_loader(index, trainer)
            return dataloader
        self._persistent = bool(getattr(dataloader, "persistent_workers", False))
        self.sampler = sampler
        self.batch_size = size
        self._resume_sampler(trainer, batch_sampler)
        if self._loader_entries() is not None:
            return dataloader
        if self._own is not None and self._own["rng"] is not None:
            # Mid-epoch: the generators go back once the loader's iterator has drawn its
            # seed, before the first batch's fetch, where the fit that stopped stood.
            self.sampler.before_first = self._restore_rng
            _quiet_lightnings_resume_warning()
        elif (state := self._take_epoch_end_rng()) is not None:
            # The next epoch's iterator: the fit that went on kept its workers and drew no
            # seed; this process makes a new one, which does. The generators go back again.
            self.sampler.before_first = functools.partial(rng.restore, state)
        return dataloader

    def train_started(self, trainer: Any) -> None:
        """At ``on_train_start``: listen for the stop signals; and, resumed from an epoch's
        last batch by a loop that finishes that epoch again (Lightning before 2.5) with the
        iterator ``setup_data`` made, put the generators back where the snapshot took them,
        for the next epoch's iterator, which the loop makes afresh (as the fit that went on
        did)."""
        self.listen(trainer)
        epoch_end, self._epoch_end = self._epoch_end, None
        if epoch_end is not None:
            epoch, state = epoch_end
            if trainer.fit_loop.epoch_progress.current.processed == epoch:
                rng.restore(state)
                if self.loaders.several:
                    # Finishing it, the combined loader starts over a loader that ran out
                    # (its iterator draws a seed), which the fit that went on did not do.
                    self._next_epoch = epoch + 1, state

    def epoch_started(self, trainer: Any) -> None:
        """At ``on_train_epoch_start``, before the epoch's loader iterator is made: after
        Lightning before 2.5 finished a snapshot's epoch again with several loaders, the
        generators go back where the snapshot took them (``train_started``)."""
        pending, self._next_epoch = self._next_epoch, None
        if pending is not None and trainer.current_epoch == pending[0]:
            rng.restore(pending[1])
        elif pending is not None and trainer.current_epoch < pending[0]:
            self._next_epoch = pending  # the finished epoch's own start: not yet

    def check_loaders(self, combined: Any) -> None:
        """At the fit's start: note the training loaders ``combined`` (the fit loop's) holds,
        and, for several, warn if a mid-epoch resume cannot keep each one's position."""
        loaders = getattr(combined, "flattened", None)
        if self.session is None or loaders is None:
            return
        mode = combined_mode(combined)
        self.loaders.started(len(loaders), mode)
        if len(loaders) < 2 or self.loaders.followed():
            return
        if mode not in FOLLOWED:
            why = f"combined in mode {mode!r}"
        else:
            why = "and not each one has the sampler Lightning puts in"
        rank_zero_warn(MANY_LOADERS.format(n=len(loaders), why=why), category=PossibleUserWarning)

    def _resume_loader(self, index: int, trainer: Any) -> None:
        """Resumed from a snapshot of several loaders' positions: resume loader ``index``'s
        sampler at its own; at another world size, once the last one is, Lightning's count
        of the epoch's batches follows. The generators go back as the loaders' first index
        is asked for once all their iterators are made."""
        entries = self._loader_entries()
        sampler = self.loaders.loaders[index].sampler
        if entries is None or sampler is None or index >= len(entries):
            return
        assert self._position is not None
        # The fit's loop tells the mode as it starts (``check_loaders``): after this.
        self.loaders.mode = self._position.get("mode", self.loaders.mode)
        ended = bool(self._position["epoch_end"])
        self.loaders.resume(index, entries[index], self._resized, ended)
        if self._resized and index == len(entries) - 1 and trainer is not None:
            self._resized = False
            _count_done(trainer, self.loaders.epoch_rest())
        if self._own is not None and self._own["rng"] is not None:
            sampler.before_first = functools.partial(self._first_fetch, index)
        _quiet_lightnings_resume_warning()

    def _first_fetch(self, index: int) -> None:
        """Loader ``index``'s first index: if it is the one asked first once every
        loader's iterator is made (``TrainingLoaders.first_fetch``), put the generators
        back."""
        if index == self.loaders.first_fetch():
            self._restore_rng()

    def _take_epoch_end_rng(self) -> dict[str, Any] | None:
        """Once: the generators at an epoch-end snapshot, if the training loader keeps its
        worker processes (else None)."""
        state, self._epoch_end_rng = self._epoch_end_rng, None
        return state if self._persistent else None

    def _resume_replay(self) -> None:
        """Mid-epoch, at the same world size: the replay sampler's next epoch goes on where
        the snapshot's stood. From an epoch's end: the next epoch starts whole."""
        entry, replay = self._position, self.replay
        if entry is None or replay is None or "world" not in entry:
            return
        del entry["world"]  # once: a loader made again for a later epoch starts it whole
        if entry["epoch_end"]:
            # The next epoch starts whole, at its own number from its first iterator; with
            # persistent workers, from the generators at the snapshot (see process_dataloader).
            started = self._take_epoch_end_rng()
            epoch = entry.get("epoch")
            after = None if epoch is None else epoch + 1
            replay.resume(0, started, _nothing, after, ended=epoch)
            return
        if self._resized:
            rank_zero_warn(
                f"bucketddp: the training sampler ({type(replay.sampler).__name__}) cannot "
                "split the rest of its epoch over another number of ranks: this epoch's rows "
                "may be used twice or not at all. Leave the sampler to Lightning (its "
                "DistributedSampler resumes exactly at any world size)."
            )
            return
        started = (self._own or {}).get("rng_epoch")
        replay.resume(entry["used"], started, self._restore_rng, entry.get("epoch"))
        _quiet_lightnings_resume_warning()

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

    def _restore_rng(self) -> None:
        """Put back this rank's generators from the snapshot, once."""
        own = self._own
        if own is not None and own["rng"] is not None:
            rng.restore(own["rng"])
            own["rng"] = None

    def _restore_own(self, wrapped: BucketDataParallel | None) -> None:
        own = self._own
        if own is None:
            return
        self._restore_rng()
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
        if self.sampler is not None or self.replay is not None:
            # The sampler keeps the position; the loader's own state would skip it twice.
            loops = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
            loops.pop("combined_loader", None)
            progress = trainer.fit_loop.epoch_loop.batch_progress.current.processed
            used = progress * self.batch_size
            checkpoint[ENTRY] = {
                "position": None if self.sampler is None else self.sampler.position(used),
                "used": used,
                "epoch_end": progress >= trainer.num_training_batches,
                "epoch": trainer.current_epoch,
            }
            if self.loaders.several and self.loaders.followed():
                loaders = self.loaders.positions(progress)
                mode = self.loaders.mode
                checkpoint[ENTRY].update(loaders=loaders, mode=mode, **_first_of(loaders))
            if self.replay is not None:
                checkpoint[ENTRY]["world"] = trainer.world_size
                own["rng_epoch"] = self.replay.started
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
        """The next epoch's generators, after a finished epoch run again (``epoch_started``)."""
        self.elastic.epoch_started(trainer)

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
