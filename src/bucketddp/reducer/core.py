"""The reducer core: from a parameter's gradient hook to averaged ``.grad`` tensors.

Each gradient of a synced backward goes through::

    autograd_hook -> mark_variable_ready -> stage (fill_slot) -> mark_bucket_ready
        -> launch_ready (strictly in plan order, so every rank issues the same collectives)
    end of backward: finalize_backward -> wait -> agree (the row) -> copy back -> reset

Rare features plug in through a few seams and are built only when the model or the
options need them: ``launch.py`` (a plain all-reduce, or a communication hook),
``agreement.py`` (the row that rides on the last bucket), ``finite.py``, ``sparse.py``,
``static_graph.py``, ``requires_grad.py``, ``module_changes.py``, ``kept_grads.py`` and
``shadow.py`` (uneven inputs). See ``docs/design.md``.

The reducer sets every field of its state (declared in ``state.py``) itself, here: the
plug-ins compute and return (``layout.build`` a ``Layout``, which ``_install`` takes), or
call a method of the reducer's.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from ..buckets import cap_bytes
from ..comm_hooks import CommHook
from ..naming import first_names
from ..notice import NOTICE
from . import errors, layout
from .agreement import check, check_local
from .autograd import COMPILED_AUTOGRAD, Once, compiled_autograd, ready_hook_first
from .copy_back import take_agreed, take_as_planned
from .deferred import defer_last
from .finite import FiniteCheck
from .kept_grads import SOLE_REFS, copy_on_write, kept_elsewhere, move_bucket
from .launch import AllReduceLauncher, checked, hook_launcher
from .members import Members
from .module_changes import ModuleChanges
from .order import checkpoint_plan, learned_plan
from .prefill import average_placed, prefill
from .requires_grad import RequiresGradWatch, reduce_joined
from .state import BufferLayout, Deferred, Launcher, ReducerState
from .static_graph import StaticGraph
from .stats import CommStats
from .storage import Bucket
from .timing import NoClock, StepClock
from .tuning import BucketTuner

if TYPE_CHECKING:
    from ..options import EngineOptions

log = logging.getLogger("bucketddp.reducer")


class ReducerPlan(ReducerState):
    """The reducer's plan and storage: which parameters it reduces, in which buckets.

    ``Reducer`` adds the hot path and the end of backward; both live here, so that the
    reducer's state is set in this module only.
    """

    def _plan_members(self, indices: list[int]) -> None:
        """Reduce the parameters at ``indices`` (into all parameters) from now on.

        Plans them in reverse registration order, to be rebuilt from the next backward's
        ready order, and hooks each of them.
        """
        self._unhook()
        self.deferred = None  # its members' hooks went with the others
        m = self.m = Members(self.all_named, indices, self.sparse_names)
        self.members, self.outside = m.indices, m.outside
        self.names, self.params = m.names, m.params
        if m.outside and self.frozen_watch is None:
            self.frozen_watch = RequiresGradWatch(self)
        if self.frozen_watch is not None:
            self.frozen_watch.forget(indices)
        self.unslotted = m.unslotted
        self.sparse = layout.sparse_gradients(m, self.process_group)
        n = len(m.params)
        self.ready = [False] * n  # got its gradient in the current backward
        self.n_ready = 0
        self.used = [False] * n  # got a gradient since the last synced backward
        self.observed = []  # the ready order, until the plan is rebuilt
        self.static = StaticGraph(self) if self.static_graph else None
        self._install(layout.build(self, m.plan(*self.caps)))
        self.gradient_hooks, self.hook_handles = layout.hook_members(self)

    def _install(self, new: layout.Layout) -> None:
        """Run on ``new``'s plan, storage and row, and move any existing gradients in.

        The one place where a layout (``layout.build``) is taken: at wrapping, when
        parameters join, when the learned order or the tuned sizes change the buckets, and
        when a comm hook on one rank needs buckets.
        """
        storage = new.storage
        self.plan, self.storage = new.plan, storage
        self.buckets, self.views, self.ptrs, self.bucket_of = (
            storage.buckets,
            storage.views,
            storage.ptrs,
            storage.bucket_of,
        )
        storage.take_grads(self.gradient_as_bucket_view)
        self.set_scales()
        if new.row is not None:
            self.row = new.row
            if self.finite is not None:
                self.finite.install()
        storage.count_own_tensors()
        if self.rank == 0:
            log.debug("bucketddp plan: %s", new.plan.describe())
        self._defer_last()

    def _defer_last(self) -> None:
        """Stage the last bucket at the end of the backward, if it can be (``deferred.py``).

        Run whenever the plan or its buckets change: hooks its previous members again first.
        """
        old = self.deferred
        if old is not None:
            self.deferred = None
            for i in old.members:
                self.hook_handles[i] = ready_hook_first(
                    self.params[i], functools.partial(self.autograd_hook, i)
                )
        deferred = defer_last(self) if self.defer_allowed else None
        if deferred is not None:
            self.deferred = deferred
            for i in deferred.members:
                self.hook_handles[i].remove()

    def _unhook(self) -> None:
        """Detach the planned parameters' hooks."""
        for h in self.hook_handles:
            h.remove()
        self.hook_handles = []

    def _adopt_learned_order(self, observed: list[int]) -> None:
        """At the end of the first synced backward: plan by rank 0's ready order from now
        on (``order.py``); the storage stays if the buckets do."""
        plan = learned_plan(self.m, observed, self.caps, self.process_group, self.device)
        self.observed = None
        if layout.same_buckets(plan, self.plan):
            self.plan = plan  # same buckets: keep the storage, remember the order
            self._defer_last()
        else:
            self._install(layout.build(self, plan))

    def load_order(self, order: Sequence[str]) -> bool:
        """Plan by a learned ``order`` (from a checkpoint); False if its names differ."""
        plan = checkpoint_plan(self, order)
        if plan is None:
            return False
        self.observed = None
        self._install(layout.build(self, plan))
        return True

    def use_caps(self, caps: tuple[int, int]) -> None:
        """Plan with bucket sizes ``caps`` (in bytes) from now on, in the current order."""
        if caps == self.caps:
            return
        self.caps = caps
        plan = self.m.plan(*caps, self.plan.order)
        if not layout.same_buckets(plan, self.plan):
            self._install(layout.build(self, plan))

    def set_scales(self) -> None:
        """Give each bucket the averaging factors of the next synced backward.

        A launcher that averages itself (a comm hook) gets plain gradients.
        """
        self.storage.set_scales(1.0 if self.launcher.averages else float(self.divisor))

    def set_training_ranks(self, ranks: int, divisor: int) -> None:
        """``ranks`` send gradients in the next synced backward, averaged over ``divisor``:
        fewer than the world size under ``join()`` (``join.py``, ``shadow.py``)."""
        self.training_ranks = ranks
        if divisor != self.divisor:
            self.divisor = divisor
            self.set_scales()

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket's gradients with ``hook(state, bucket)`` from the next step on."""
        self.launcher = hook_launcher(self, state, hook)
        self.set_scales()
        if not self.communicates:
            # One rank: buckets exist only to hand the hook its gradients, as torch DDP does.
            self.communicates = True
            self._install(layout.build(self, self.plan))


class Reducer(ReducerPlan):
    """Owns the hooks, the bucket storage and the in-flight collectives of one model."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        *,
        process_group: dist.ProcessGroup | None,
        options: EngineOptions,
        sparse_names: Collection[str] = (),
        buffer_layout: BufferLayout | None = None,
    ) -> None:
        """Reduce those of ``named_params`` (all the model's) that require a gradient.

        ``sparse_names``: embeddings' parameters with ``sparse=True``. ``buffer_layout``:
        the wrapper's buffer sync, whose layout changes travel in the agreement row.
        """
        self.all_named = list(named_params)
        self.all_names = [n for n, _ in named_params]
        self.all_params = [p for _, p in named_params]
        trainable = [j for j, p in enumerate(self.all_params) if p.requires_grad]
        if not trainable:
            raise ValueError(errors.NO_TRAINABLE)
        self.sparse_names = frozenset(sparse_names)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        # A static graph may leave parameters unused, as torch DDP allows.
        self.find_unused_parameters = options.find_unused_parameters or options.static_graph
        self.gradient_as_bucket_view = options.gradient_as_bucket_view
        self.unused_hint = options.unused_hint
        self.buffer_layout = buffer_layout
        self.caps = cap_bytes(options.bucket_sizes[0]), cap_bytes(options.bucket_sizes[1])
        tuned = options.tuned_sizes
        self.tuner = BucketTuner(self, *tuned) if tuned is not None else None
        self.static_graph = options.static_graph
        self.finite = FiniteCheck(self) if options.check_finite else None
        self.launcher: Launcher = checked(self, AllReduceLauncher(process_group))
        self.clock = StepClock() if options.telemetry else NoClock()
        # One rank has nothing to reduce: no storage, and the hooks only check (unless a
        # communication hook is registered).
        self.communicates = self.world_size > 1
        # Gradients are averaged over ``divisor`` ranks, and ``training_ranks`` send some:
        # the world size, or fewer under ``join()``.
        self.divisor = self.training_ranks = self.world_size
        self.sync_enabled = True
        # torch DDP's contract: the hooks act only in a backward that follows a grad-enabled
        # forward through the wrapper (``expect_backward``), whose sync decision they keep.
        self.expecting_backward = False
        self.sync_step = True
        self._queued = False
        self._from_output = False  # the end-of-backward callback was queued by an output hook
        # A gradient the ready count does not show arrived (outside the plan, or not a
        # static graph parameter's last).
        self.touched_elsewhere = False
        self.hook_handles: list[RemovableHandle] = []
        self.frozen_watch: RequiresGradWatch | None = None
        self.module_changes: ModuleChanges | None = None
        self._next = 0  # the next bucket to launch, in plan order
        # The last bucket, staged at the end of the backward (deferred.py), unless a step
        # showed that .grad cannot tell which of its members got a gradient.
        self.deferred: Deferred | None = None
        self.defer_allowed = True
        self._plan_members(trainable)

    @property
    def stats(self) -> CommStats:
        """Figures of the last synced backward (built when asked for)."""
        return self.clock.last()

    # ------------------------------------------------------------------- the hot path
    def autograd_hook(self, i: int, param: torch.Tensor) -> None:
        """Parameter ``i``'s gradient was accumulated into ``param.grad``."""
        if self.expecting_backward and self.mark_variable_ready(i):
            self.stage(i, param)

    def unslotted_hook(self, i: int, param: torch.Tensor) -> None:
        """A gradient reduced outside the slots (sparse): counted towards the last bucket."""
        if self.expecting_backward and self.mark_variable_ready(i):
            self.mark_bucket_ready(self.bucket_of[i])

    def mark_variable_ready(self, i: int) -> bool:
        """Record that parameter ``i`` got its gradient; returns whether to communicate."""
        if not self._queued:
            self.queue_finalize()
        if self.ready[i]:
            raise RuntimeError(errors.twice(self.names[i]))
        self.ready[i] = True
        self.n_ready += 1
        self.used[i] = True
        if self.observed is not None:
            self.observed.append(i)
        return self.sync_step and self.communicates

    def stage(self, i: int, param: torch.Tensor) -> None:
        """Put parameter ``i``'s gradient in its bucket slot, then launch what is due."""
        bucket = self.bucket_of[i]
        if i in bucket.placed:
            view = self.views[i]
            if param.grad is view and view.data_ptr() == self.ptrs[i]:
                # Accumulated in its placed slot (prefill.py): only counted, no checks.
                bucket.written = True
                self.mark_bucket_ready(bucket)
                return
        if self.n_ready == 1 and self.gradient_as_bucket_view and not self.find_unused_parameters:
            prefill(self, i)  # the step's first gradient: the others may go in place
        grad = param.grad
        view = self.fill_slot(i, grad)
        if self.gradient_as_bucket_view and grad is not view:
            param.grad = view
        self.mark_bucket_ready(bucket)

    def mark_bucket_ready(self, bucket: Bucket) -> None:
        """One gradient of ``bucket`` fewer to wait for; launch what is due once it is full."""
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready_at = time.perf_counter()
            self.launch_ready()

    def fill_slot(self, i: int, grad: torch.Tensor | None) -> torch.Tensor:
        """Stage gradient ``i`` in its slot, already divided by the world size; returns the slot.

        Averaging before the sum is torch DDP's order, and so is the arithmetic: a copied
        gradient is multiplied by ``1 / world_size`` on its way in (``out=`` fuses the two),
        a gradient accumulated in place is divided. The gradients placed in their slots
        (``prefill.py``) are multiplied when their bucket launches instead.
        """
        view = self.views[i]
        if view.data_ptr() != self.ptrs[i]:
            # A conversion after wrapping (model.to(memory_format=...), .double()) set the
            # ``.data`` of every gradient, and the view was one: the slot gets a new view.
            view = self.storage.reslot(i)
        bucket = self.bucket_of[i]
        first = not bucket.written
        bucket.written = True
        if grad is view:  # accumulated in place, in the slot
            if i not in bucket.placed:  # else averaged at its launch (prefill.py)
                view.div_(bucket.divisor)
            return view
        if sys.getrefcount(view) > SOLE_REFS:
            # Someone kept this slot's view, the .grad of an earlier step.
            view = copy_on_write(self.storage, i)
        if first and not bucket.placed and kept_elsewhere(self.storage, bucket):
            # Someone kept another tensor on the bucket's memory from an earlier step (for
            # a bucket with placed slots, prefill checked; the bucket must not move now).
            view = move_bucket(self.storage, bucket, self.row, i)
        if grad is None:
            view.zero_()
            return view
        if bucket.placed:
            bucket.placed.discard(i)  # placed, but its .grad was replaced since: copied
        if grad.layout != torch.strided or grad._base is not None or grad.dtype != view.dtype:
            errors.check_gradient(self.names[i], grad, view, self.storage)
        try:
            torch.mul(grad, bucket.scale, out=view)
        except RuntimeError:
            if grad.requires_grad:
                raise RuntimeError(errors.create_graph(self.names[i])) from None
            raise
        return view

    def launch_ready(self) -> None:
        """Launch every bucket whose turn has come, in plan order."""
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            bucket = buckets[self._next]
            last = bucket.row is not None
            if last:  # the last bucket: what rides on it goes first
                self._before_last()
            if bucket.placed:
                average_placed(self, bucket)
            bucket.work = self.launcher.launch(self._next, bucket)
            self.clock.launched(self._next, bucket.work, last=last)
            self._next += 1

    # ------------------------------------------------------------- end of backward
    def finalize_backward(self) -> None:
        """Runs once at the end of each backward pass that touched a parameter."""
        if self.deferred is not None:
            self._count_deferred(self.deferred)
        node = torch._C._current_autograd_node()
        if node is not None and not self._from_output and self.n_ready < len(self.ready):
            # The end of a backward nested in another (a reentrant checkpoint segment's)
            # while gradients may still come, queued by a parameter's hook because no output
            # hook did in the outer one: finish at the end of the enclosing backward.
            node.register_hook(Once(self._requeue_finalize))
            return
        self._queued = False
        touched = self.n_ready > 0 or self.touched_elsewhere
        if touched and node is None:
            self.expecting_backward = False  # until the next forward
        if not self.sync_step or not touched:
            self.reset_step()
            return
        try:
            error, joined = self._reduce() if self.communicates else check_local(self)
        finally:
            self.reset_step(synced=True)
        self.end_synced_step(error, joined)

    def _count_deferred(self, deferred: Deferred) -> None:
        """Count the deferred members that got a gradient in this backward as ready."""
        for i in deferred.arrivals(self.ready, self.params, self.views):
            self.ready[i] = True
            self.used[i] = True
            self.n_ready += 1

    def _reduce(self) -> tuple[str | None, list[int]]:
        """Launch what is left, wait for everything, agree; returns (error, joining params)."""
        if self.static is not None:
            self.static.before_reduce()
        if self.deferred is not None:
            self.deferred.stage(self)
        missing_here: list[int] = []
        if self.n_ready < len(self.ready):
            missing_here = [i for i, ready in enumerate(self.ready) if not ready]
        for i in missing_here:
            if i not in self.unslotted:
                self.fill_slot(i, self.params[i].grad)
            self.bucket_of[i].pending -= 1
        self.launch_ready()
        start = self.clock.wait_begins()
        if self.sparse is not None:
            self.sparse.wait()
        self.launcher.wait_all(self.buckets)
        sparse = self.sparse
        self.clock.finish(
            self.buckets,
            collectives=len(self.buckets)
            + (sparse.collectives if sparse is not None else 0)
            + self.launcher.extra_collectives,
            bytes_reduced=self.storage.nbytes + (sparse.nbytes() if sparse is not None else 0),
            wait_seconds=time.perf_counter() - start,
            buckets=len(self.buckets),
        )
        if self.row.summed_is_planned():
            # The common step: on every rank every planned parameter got its gradient and
            # nothing changed (so nothing is missing here either).
            take_as_planned(self, missing_here)
            return None, []
        counts, agreement = self.row.read()
        error, frozen, joined = check(self, counts, agreement, bool(missing_here))
        if error is not None:
            return error, []
        take_agreed(self, counts.tolist(), frozen, missing_here)
        return (reduce_joined(self, joined) if joined else None), joined

    def end_synced_step(self, error: str | None, joined: list[int]) -> None:
        """After a synced backward: raise its error, or take in joining parameters, or rebuild."""
        if error is not None:
            raise RuntimeError(error)
        if joined:
            self._plan_members(sorted(self.members + joined))
            log.info(
                "bucketddp: %d parameter(s) now require a gradient on every rank and join the "
                "buckets: %s",
                len(joined),
                first_names([self.all_names[j] for j in joined]),
            )
        elif self.observed is not None:
            self._adopt_learned_order(self.observed)
        if self.tuner is not None and not self.tuner.done:
            self.tuner.after_step(joining=self.training_ranks < self.world_size)

    def reset_step(self, *, synced: bool = False) -> None:
        """Ready for the next backward: nothing ready, nothing launched, nothing queued.

        ``synced``: the gradients since the last synced backward were reduced (or
        discarded), so none counts as used any more either.
        """
        self._queued = False
        if synced:
            self.used = [False] * len(self.used)
        n = len(self.ready)
        self.ready = [False] * n
        self.n_ready = 0
        self._next = 0
        self.touched_elsewhere = False
        if self.static is not None:
            self.static.reset()
        if self.sparse is not None:
            self.sparse.reset()
        for bucket in self.buckets:
            bucket.pending = bucket.expected
            bucket.written = False
            bucket.placed.clear()
        deferred = self.deferred
        if deferred is not None:
            deferred.remember(synced, self.params, self.views)
            if deferred.blind:
                # A member's .grad was its slot: counted this step, hooked from the next one.
                self.defer_allowed = False
                self._defer_last()

    # ------------------------------------------------------- seams for the plug-ins
    def _before_last(self) -> None:
        """Launch the sparse gradients' reduction, then write this rank's agreement row."""
        if self.sparse is not None:
            self.sparse.launch(self.used, self.divisor)
        changes = (
            (self.frozen_watch is not None and self.frozen_watch.trainable)
            or (self.module_changes is not None and self.module_changes.reported)
            or self.buffers_changed()
            or NOTICE.pending
        )
        self.row.write(self, changes=changes)

    def buffers_changed(self) -> bool:
        """Whether this rank's synced buffers changed layout since the ranks agreed."""
        return self.buffer_layout is not None and self.buffer_layout.layout_changed

    # ------------------------------------------------- what the wrapper tells the reducer
    def before_forward(self) -> None:
        """Before a forward: notice parameters outside the plan that now require grad, and
        hooks on deferred members (which then get the reducer's back)."""
        if self.deferred is not None and self.deferred.hooked():
            self._defer_last()
        if self.module_changes is not None:
            self.module_changes.check_frozen()
        if self.frozen_watch is not None:
            self.frozen_watch.before_forward()

    def module_changed(
        self, added: Sequence[tuple[str, nn.Parameter]], removed: Sequence[str]
    ) -> None:
        """The module holds ``added`` parameters it did not hold when wrapped (see
        ``module_changes.py``)."""
        if self.module_changes is None:
            self.module_changes = ModuleChanges(self.outside_gradient)
        self.module_changes.update(added, removed)

    def used_not_ready(self, i: int) -> None:
        """Parameter ``i`` got a gradient that is not its last of this backward
        (``static_graph.py``): used, even if the last never comes, and not ready yet."""
        self.used[i] = True
        self.touched_elsewhere = True
        if not self._queued:
            self.queue_finalize()

    def outside_gradient(self, param: torch.Tensor) -> None:
        """A hook for parameters outside the plan: the backward must reach its end."""
        if not self.expecting_backward:
            return
        self.touched_elsewhere = True
        self.queue_finalize()

    def enable_sync(self, enabled: bool) -> None:
        """Whether the backward after the next forward syncs (``no_sync()`` clears it)."""
        self.sync_enabled = enabled

    def expect_backward(self, *, decide: bool = False) -> None:
        """At a grad-enabled forward: the next backward is this reducer's to reduce.

        It syncs unless this forward runs inside ``no_sync()`` (torch DDP decides at the
        forward too), or, after an auxiliary forward, if any forward since the last backward
        asked it to. ``decide`` (``prepare_for_backward``) sets the decision outright.
        """
        keep = not decide and self.expecting_backward and self.sync_step
        self.sync_step = self.sync_enabled or keep
        self.expecting_backward = True

    def on_output_grad(self, grad: torch.Tensor) -> None:
        """A hook on the forward's outputs: their gradient opens the backward pass.

        It runs in the outermost backward, so the end-of-backward callback waits for the
        whole pass, not a reentrant checkpoint segment's nested one.
        """
        self.expecting_backward = True  # a second backward through these outputs counts
        if not self._queued:
            self.queue_finalize()
            self._from_output = True

    def queue_finalize(self) -> None:
        """Have the autograd engine call ``finalize_backward`` at the end of this backward."""
        if self._queued:
            return
        if compiled_autograd():
            raise RuntimeError(COMPILED_AUTOGRAD)
        self._queued = True
        self._from_output = False
        Variable._execution_engine.queue_callback(self.finalize_backward)

    def _requeue_finalize(self) -> None:
        Variable._execution_engine.queue_callback(self.finalize_backward)

    @property
    def in_backward(self) -> bool:
        """Whether a backward pass of this reducer's is under way (its callback is queued)."""
        return self._queued

    def remove(self) -> None:
        """Detach the hooks; the parameters keep their current gradients."""
        self._unhook()
        for plugin in (self.frozen_watch, self.module_changes):
            if plugin is not None:
                plugin.remove()
