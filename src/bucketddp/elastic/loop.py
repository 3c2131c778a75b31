"""``Elastic``: snapshots and resume for a hand-written loop (``BucketDataParallel``, Fabric).

The loop names what makes up its state, marks each step's end, and calls ``resume()`` once
before training. Under torchrun, after a worker dies and torchrun restarts every worker,
``resume()`` finds the newest snapshot on any node and puts it back into that state.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .. import hook_state
from ..bucket_plan import adopt_plan, plan_entry
from ..notice import NOTICE
from ..parallel import BucketDataParallel
from . import collector, rng, room
from .job import NOT_UNDER_TORCHRUN
from .overlap import enabled, late_tensors, optimizers_in, settle_before_steps
from .sampler import ElasticSampler, EpochPosition
from .session import Session, open_session


def wrapper_of(value: object) -> BucketDataParallel | None:
    """The ``BucketDataParallel`` that ``value`` is or holds as a child (the module
    ``fabric.setup`` returns), if any."""
    if isinstance(value, BucketDataParallel):
        return value
    if isinstance(value, torch.nn.Module):
        for child in value.children():
            if isinstance(child, BucketDataParallel):
                return child
    return None


def hook_parts(wrapper: BucketDataParallel) -> tuple[dict[str, Any], Any]:
    """The wrapper's communication hook state for a snapshot: (shared entry, own part)."""
    shared, own = hook_state.capture(wrapper.comm_hook_state)
    return {"shared": shared, "has_own": own is not None}, own


def restore_hook(wrapper: BucketDataParallel, entry: dict[str, Any] | None, own: Any) -> None:
    """Put back what ``hook_parts`` kept (``own`` is None at another world size)."""
    if entry is None or (entry["shared"] is None and not entry["has_own"]):
        return
    state = wrapper.comm_hook_state
    if state is None:
        raise RuntimeError(
            "bucketddp: the snapshot holds a communication hook's state, but no hook is "
            "registered on the wrapper yet: call register_comm_hook before resuming"
        )
    hook_state.restore(state, entry["shared"], own, had_own=entry["has_own"])


def own_buffers(wrapper: BucketDataParallel) -> dict[str, Any]:
    """This rank's own buffer values at a snapshot, put back on this rank alone after a
    resume at an unchanged world size: the rank-local (``"none"``) buffers, and the
    ``"broadcast"`` ones when no policy combines the ranks' values. A snapshot then makes no
    sync (``sync_buffers_to_save``), so those may differ from rank 0's until the next
    forward's sync, exactly as in a run that was never interrupted."""
    sync = wrapper.buffers_sync
    names = set(sync.rank_local)
    if not sync.combines:
        names |= {n for n, p in sync.policies.items() if p == "broadcast"}
    if not names:  # most models: no walk over the modules
        return {}
    return {n: b.detach().clone() for n, b in wrapper.module.named_buffers() if n in names}


def load_own_buffers(wrapper: BucketDataParallel, values: dict[str, Any]) -> None:
    """Put this rank's own buffer values (``own_buffers``) back."""
    buffers = dict(wrapper.module.named_buffers())
    for name, value in values.items():
        if name in buffers:
            buffers[name].data.copy_(value)


_IN_JOBS: weakref.WeakSet[ElasticSampler] = weakref.WeakSet()


def in_a_job(sampler: object) -> bool:
    """Whether ``sampler`` was given to an ``Elastic`` job (which keeps its position)."""
    return isinstance(sampler, ElasticSampler) and sampler in _IN_JOBS


def draws_from(loader: object, sampler: object) -> bool:
    """Whether ``loader`` takes its indices from ``sampler``, directly or through its batch
    sampler."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    return sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None))


class Elastic:
    """Snapshots of a hand-written loop's state in node-local shared memory, and resume
    from them after torchrun restarts the workers (``docs/elastic.md``).

    Args:
        state: what to snapshot and restore, by name. A value with ``state_dict()`` and
            ``load_state_dict()`` (a model, wrapped or not, an optimizer, an LR scheduler,
            a StatefulDataLoader) is restored in place; any other value (a step counter, an
            epoch number) is put back into ``state``.
        every: take a snapshot every this many steps.
        sampler: the training data's ``ElasticSampler``: after a restart, even at another
            world size, the epoch goes on with the samples no rank has used yet. A loader
            in ``state`` that draws from it (a StatefulDataLoader) keeps no state of its own
            in the snapshots: its fast-forward would skip the used samples a second time.
        batch_size: samples per rank per batch (needed with ``sampler``).
        group: the process group (the default one if None).
        signals: the signals that stop every rank together after the current step, with a
            snapshot of it (``"SIGTERM,SIGUSR1"``, or ``"none"``); if None,
            ``BUCKETDDP_STOP_SIGNALS``, else SIGTERM and SIGUSR1. The notice rides on the
            wrapper's own all-reduce; with no ``BucketDataParallel`` in ``state`` it costs
            one small all-reduce per step.
        preempt_dir: a folder (on disk, reachable from every node that may run the job)
            that a stop on a signal also copies its snapshot to; the job, started again
            anywhere, resumes from it. If None, ``BUCKETDDP_PREEMPT_DIR``, else none.
        requeue: under SLURM's srun, rank 0 runs ``scontrol requeue`` once a stop's
            snapshot is in ``preempt_dir``.
        overlap: copy the parameters and optimizer states of the optimizers in ``state``
            while the next step's forward and backward run (their next ``step()`` waits for
            the copy); False copies everything at ``step()``, for a loop that changes
            weights outside ``optimizer.step()``. If None, ``BUCKETDDP_SNAPSHOT_OVERLAP``
            (``0``: off), else on.

    Outside torchrun (and SLURM with ``preempt_dir``), nothing would resume the workers:
    it warns once and takes no snapshots (``resume()`` returns False), so the same script
    runs anywhere.
    """

    def __init__(
        self,
        state: dict[str, Any],
        *,
        every: int = 1,
        sampler: ElasticSampler | None = None,
        batch_size: int | None = None,
        group: dist.ProcessGroup | None = None,
        signals: str | None = None,
        preempt_dir: str | os.PathLike[str] | None = None,
        requeue: bool = False,
        overlap: bool | None = None,
    ) -> None:
        if sampler is not None and not isinstance(sampler, ElasticSampler):
            raise TypeError(
                f"Elastic(sampler=...) got a {type(sampler).__name__}, which cannot resume an "
                "epoch: give the loader a bucketddp.elastic.ElasticSampler (it takes "
                "DistributedSampler's arguments and draws its order)"
            )
        if sampler is not None and (batch_size is None or batch_size < 1):
            raise ValueError(
                "Elastic(sampler=...) needs batch_size: the samples per rank per batch"
            )
        self.state = state
        self.session: Session | None = open_session(
            every, group, signals, preempt_dir, requeue=requeue
        )
        # The optimizers wait for a snapshot's copy of what they change (``overlap.py``).
        overlapped = self.session is not None and enabled(overlap)
        self._optimizers = optimizers_in(state.values()) if overlapped else []
        if self.session is not None:
            self._settling = settle_before_steps(self._optimizers, self.session.settle)
            self.session.listen()
        else:
            warnings.warn(NOT_UNDER_TORCHRUN, stacklevel=2)
        self.sampler = sampler
        if sampler is not None:
            _IN_JOBS.add(sampler)
        self.batch_size = batch_size or 0
        self.steps = 0
        self.finished = False  # resumed from the end of a finished run: no step is left
        self._epoch: int | None = None
        self._used = 0  # samples per rank used in the sampler's current epoch

    def resume(self) -> bool:
        """Restore the newest snapshot, if any node has one; returns whether it did. Call it
        on every rank, once, after the model and optimizers exist and before training.

        After a restart that came once the loop had finished (a rank died after
        ``finish()``), the state is the one ``finish()`` saw, and ``finished`` is True: a
        loop whose bounds come from the state (an epoch counter, ``steps``) does no step."""
        session = self.session
        values = [value for _, value in self._kept()]
        restored = session.restore(room.estimate(values)) if session else None
        if restored is None:
            return False
        saved = restored.state
        for name, value in saved["state"].items():
            current = self.state.get(name)
            if hasattr(current, "load_state_dict"):
                assert current is not None
                current.load_state_dict(value)
            else:
                self.state[name] = value
        for name, plan in saved["plans"].items():
            if (wrapper := wrapper_of(self.state.get(name))) is not None:
                adopt_plan(wrapper, plan)
                wrapper.buffers_sync.reset_baseline()  # the loaded "sum" totals are agreed
        self.steps = saved["steps"]
        self.finished = restored.finished
        if self.sampler is not None and saved["position"] is not None:
            self.sampler.resume(saved["position"], 0)
            self._epoch, self._used = saved["position"].epoch, 0
        own = restored.own
        if own is not None:  # this rank had a part: its own generators and buffers
            rng.restore(own["rng"])
            if self.sampler is not None and saved["position"] is not None:
                self._restore_rng_again(self.sampler, saved["position"].epoch, own["rng"])
            for name, values in own["buffers"].items():
                if (wrapper := wrapper_of(self.state.get(name))) is not None:
                    load_own_buffers(wrapper, values)
        for name, entry in saved.get("hooks", {}).items():
            if (wrapper := wrapper_of(self.state.get(name))) is not None:
                mine = own.get("hooks", {}).get(name) if own is not None else None
                restore_hook(wrapper, entry, mine)
        return True

    @staticmethod
    def _restore_rng_again(sampler: ElasticSampler, epoch: int, state: Any) -> None:
        """Put the generators back once more as the loader asks for the resumed epoch's
        first index: the loop's draws at an epoch's start (a loader iterator's seed, drawn
        from the global generator unless the loader has its own) came before the snapshot
        in the interrupted run, and come again after ``resume()`` here. Only if that
        iteration is the resumed epoch's (for one that ended at the snapshot: its empty
        iteration, before the next epoch's draws)."""

        def again() -> None:
            if sampler.epoch == epoch:
                rng.restore(state)

        sampler.before_first = again

    def step(self, batches: int = 1) -> None:
        """Mark the end of a step (after ``optimizer.step()``) that used ``batches`` batches
        per rank; takes a snapshot when one is due."""
        self.steps += 1
        position = self._advance(batches)
        if self.session is None:
            return
        if self.finished:
            self.finished = False
            self.session.listen()
            warnings.warn(
                "bucketddp: a step after resuming a loop that had finished: it trains past "
                "the state finish() saw (take the loop's bounds from the state)",
                stacklevel=2,
            )
        if not any(wrapper_of(v) is not None for v in self.state.values()):
            self._agree_on_notice()
        if not self.session.due(self.steps):
            return
        with collector.held_off():
            late = late_tensors(self._optimizers)
            self.session.take(self.steps, *self._parts(position), late=late)
        if NOTICE.agreed:
            self.session.stop(self.steps)

    def _parts(self, position: EpochPosition | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """A snapshot's shared state and this rank's own part, as of now."""
        saved: dict[str, Any] = {"state": {}, "plans": {}, "hooks": {}, "steps": self.steps}
        own: dict[str, Any] = {"rng": rng.capture(), "buffers": {}, "hooks": {}}
        for name, value in self._kept():
            wrapper = wrapper_of(value)
            if wrapper is not None:
                wrapper.sync_buffers_to_save()  # as a checkpoint has them
                saved["plans"][name] = plan_entry(wrapper)
                own["buffers"][name] = own_buffers(wrapper)
                saved["hooks"][name], own["hooks"][name] = hook_parts(wrapper)
            saved["state"][name] = value.state_dict() if hasattr(value, "state_dict") else value
        saved["position"] = position
        return saved, own

    def _kept(self) -> list[tuple[str, Any]]:
        """What the snapshots hold of ``state``: all but a loader drawing from ``sampler``,
        which keeps the position (not even asked for its ``state_dict()``, which makes a
        StatefulDataLoader draw its next epoch's order at once)."""
        sampler = self.sampler
        items = self.state.items()
        return [(n, v) for n, v in items if sampler is None or not draws_from(v, sampler)]

    def _agree_on_notice(self) -> None:
        # No wrapper's row carried the stop flag this step: an all-reduce of its own.
        assert self.session is not None
        if dist.get_world_size(self.session.group) > 1:
            flag = torch.tensor([float(NOTICE.pending)])
            dist.all_reduce(flag, group=self.session.group)
            NOTICE.heard(float(flag.item()))
        else:
            NOTICE.heard(float(NOTICE.pending))

    def _advance(self, batches: int) -> EpochPosition | None:
        sampler = self.sampler
        if sampler is None:
            return None
        if sampler.epoch != self._epoch:
            self._epoch, self._used = sampler.epoch, 0
        self._used += batches * self.batch_size
        return sampler.position(self._used)

    def finish(self) -> None:
        """Training is over (a collective): a snapshot of the state now, marked finished, is
        kept until every worker of the node has exited cleanly, so that a restart before
        then (a rank that dies later in the script) resumes at the end, with no step left.
        The snapshots are removed then, or at any exit of torchrun's last attempt."""
        session = self.session
        if session is None:
            return
        if self.finished:  # resumed at the end: that snapshot is this state
            session.finish()
        else:
            session.finish(self.steps, *self._parts(self._advance(0)))
