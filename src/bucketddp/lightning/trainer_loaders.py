"""``BucketDDP(elastic=True)``: the training loaders' side of a snapshot and its resume.

``trainer_elastic.py`` takes the snapshots and agrees on one to resume from; this module
does what concerns the training loaders (``ElasticLoaders``):

- the training loader's ``DistributedSampler`` (the one Lightning puts in) becomes an
  ``ElasticSampler`` following its epoch, so a resumed epoch goes on with the samples no
  rank has used yet, at any world size; any other sampler is wrapped in a
  ``ReplaySampler``, which resumes an epoch at the same world size by drawing its order
  again and skipping what was used; with several training loaders, each one's
  ``ElasticSampler`` keeps its own position (``bucketddp.elastic.loaders``);
- a snapshot keeps each loader's position in its epoch (the checkpoint's ``ENTRY``);
- a resume puts each sampler there and the generators where the loader starts the resumed
  epoch's first batch (its iterator made, the batch not yet fetched, as in the fit that was
  interrupted, so an augmentation drawn in the dataset draws the same); at another world
  size, Lightning's count of the epoch's batches follows the rows left.

Like ``trainer.py``, it imports Lightning.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DistributedSampler

from ..elastic import rng
from ..elastic.loaders import FOLLOWED, TrainingLoader, TrainingLoaders, batches_left
from ..elastic.replay import ReplaySampler
from ..elastic.sampler import ElasticSampler, same_order
from .internals import combined_mode

ENTRY = "bucketddp_elastic"
"""The checkpoint entry with the training sampler's position."""


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


class ElasticLoaders:
    """The training loaders of an elastic fit: the samplers put in them, the positions a
    snapshot keeps, and where a resume puts them and the generators (module docstring)."""

    def __init__(self) -> None:
        self.sampler: _FollowingSampler | None = None
        self.replay: ReplaySampler | None = None  # any other sampler, wrapped
        self.batch_size = 0
        # The fit's training loaders (several: each one's position is kept).
        self.loaders = TrainingLoaders()
        # This rank's own part of the snapshot resumed from (its generators), until they
        # are back.
        self.own: dict[str, Any] | None = None
        self._position: dict[str, Any] | None = None  # the sampler's, from the snapshot
        self._resized = False  # resumed at another world size; the epoch's count to redo
        self._persistent = False  # the training loader keeps its worker processes
        # Resumed from an epoch's last batch: the generators there, for a loader with
        # persistent workers, whose next epoch drew no seed in the fit that went on.
        self._epoch_end_rng: dict[str, Any] | None = None
        # Resumed from an epoch's last batch: that epoch and the generators there, until the
        # training starts (``train_started``).
        self._epoch_end: tuple[int, dict[str, Any]] | None = None
        # Those generators again, for the next epoch's start, where Lightning before 2.5
        # finished that epoch again with several loaders (``epoch_started``).
        self._next_epoch: tuple[int, dict[str, Any]] | None = None

    def fit_starts(self, own: dict[str, Any] | None) -> None:
        """A fit starts (in the launcher), resumed with this rank's ``own`` part (its
        generators) or from nothing."""
        self._epoch_end_rng = self._epoch_end = None
        if own is not None:
            self.own = own

    def restored(self, state: dict[str, Any], resized: bool) -> None:
        """The snapshot's checkpoint ``state`` is being loaded (taken at another world size
        if ``resized``): resume the samplers made so far; from an epoch's last batch, put
        the generators back now."""
        self._position = state.get(ENTRY)
        self._resized = resized
        self._resume_sampler()
        self._resume_replay()
        if self._position is not None and self._position["epoch_end"]:
            # Taken on an epoch's last batch: the fit that went on made the next epoch's
            # loader iterator (which draws a seed) after it; so does this one, from here.
            self._epoch_end_rng = (self.own or {}).get("rng")
            if self._epoch_end_rng is not None and self._position.get("epoch") is not None:
                self._epoch_end = self._position["epoch"], self._epoch_end_rng
            self.restore_rng()

    def restore_rng(self) -> None:
        """Put back this rank's generators from the snapshot, once."""
        own = self.own
        if own is not None and own["rng"] is not None:
            rng.restore(own["rng"])
            own["rng"] = None

    def _rng_pending(self) -> bool:
        """Whether the snapshot's generators are still to be put back."""
        return self.own is not None and self.own["rng"] is not None

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
        if self._rng_pending():
            # Mid-epoch: the generators go back once the loader's iterator has drawn its
            # seed, before the first batch's fetch, where the fit that stopped stood.
            self.sampler.before_first = self.restore_rng
            _quiet_lightnings_resume_warning()
        elif (state := self._take_epoch_end_rng()) is not None:
            # The next epoch's iterator: the fit that went on kept its workers and drew no
            # seed; this process makes a new one, which does. The generators go back again.
            self.sampler.before_first = functools.partial(rng.restore, state)
        return dataloader

    def train_started(self, trainer: Any) -> None:
        """At ``on_train_start``: resumed from an epoch's last batch by a loop that finishes
        that epoch again (Lightning before 2.5) with the iterator ``setup_data`` made, put
        the generators back where the snapshot took them, for the next epoch's iterator,
        which the loop makes afresh (as the fit that went on did)."""
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
        if loaders is None:
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
        if self._rng_pending():
            sampler.before_first = functools.partial(self._first_fetch, index)
        _quiet_lightnings_resume_warning()

    def _first_fetch(self, index: int) -> None:
        """Loader ``index``'s first index: if it is the one asked first once every
        loader's iterator is made (``TrainingLoaders.first_fetch``), put the generators
        back."""
        if index == self.loaders.first_fetch():
            self.restore_rng()

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
        started = (self.own or {}).get("rng_epoch")
        replay.resume(entry["used"], started, self.restore_rng, entry.get("epoch"))
        _quiet_lightnings_resume_warning()

    def keeps(self) -> bool:
        """Whether a snapshot keeps the training loader's position (``add_position``)."""
        return self.sampler is not None or self.replay is not None

    def add_position(self, trainer: Any, checkpoint: dict[str, Any], own: dict[str, Any]) -> None:
        """Put the training loaders' positions in a snapshot's ``checkpoint`` (and what the
        replay sampler needs in this rank's ``own`` part), if a sampler of ours keeps one."""
        if not self.keeps():
            return
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
