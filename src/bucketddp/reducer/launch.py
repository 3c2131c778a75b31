"""Launchers: how a full bucket goes on the wire, chosen once per reducer.

The default launcher sums the bucket's storage with one asynchronous all-reduce; the
gradients were already divided by the world size on their way into the slots. With a
registered communication hook, the hook launcher hands each bucket's plain gradients to
the hook as soon as the bucket is full (or, for a hook that launches collectives from its
callbacks, once the previous bucket's future is done) and takes back what its future
holds. Each is a ``Launcher`` (the protocol in ``state.py``): the core calls ``launch``
and ``wait_all`` and never asks which one it has, as torch DDP's reducer falls back to a
default all-reduce hook. With ``check_finite=True`` either one is wrapped in a
``CheckedLauncher``, which looks at each bucket first (``finite.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..comm import AsyncSum, on_wire, private_copy, wait_kept
from ..comm_hooks import (
    CommHook,
    GradBucket,
    averages_exactly,
    averaging_wire,
    call_after,
    fit_row_error,
    hook_result,
    launches_from_callbacks,
    row_in_powersgd,
    run_hook,
)
from . import errors
from .native_hooks import native_hook
from .sparse import SparseGradients
from .state import FiniteGuard, Launcher, ReducerState
from .storage import Bucket, slot_views


class AllReduceLauncher:
    """Sums each bucket's storage, row included, with one asynchronous all-reduce."""

    averages = False
    """Whether it averages itself (False: the slots hold gradients already averaged)."""
    extra_collectives = 0
    """Collectives per step besides one per bucket."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self._sum = AsyncSum(group)

    def launch(self, k: int, bucket: Bucket) -> dist.Work:
        """Start reducing bucket ``k``; returns what to wait on."""
        return self._sum(on_wire(bucket.storage))

    def wait_all(self, buckets: Sequence[Bucket]) -> None:
        """Wait for every bucket; their storages then hold the sums."""
        for bucket in buckets:
            bucket.wait()

    def reduce_copies(
        self,
        storages: list[torch.Tensor],
        buckets: Sequence[Bucket],
        sparse: SparseGradients | None,
    ) -> None:
        """Reduce stand-ins for ``buckets`` (a joined rank's zeros), in launch order.

        Empty ``sparse`` gradients go just before the last bucket, as in a step.
        """
        works = [self._sum(on_wire(t)) for t in storages[:-1]]
        if sparse is not None:
            sparse.launch_stand_ins()
        works.append(self._sum(on_wire(storages[-1])))
        for work in works:
            work.wait()
        if sparse is not None:
            sparse.wait()


class HookLauncher:
    """Reduces each bucket's gradients with a registered ``hook(state, bucket)``.

    Each bucket's hook is called as soon as the bucket is full (torch's averaging hooks,
    registered as they are, are run here instead, with no callback: ``native_hooks.py``).
    A hook that launches collectives from its futures' callbacks (PowerSGD; see
    ``comm_hooks.py``) is *ordered*: bucket ``k``'s call waits until bucket ``k - 1``'s
    future is done, so that those collectives keep one order on every rank.

    The agreement row rides in the last bucket's buffer when the hook is one of torch's
    that average the whole buffer elementwise over the wrapper's group (``allreduce_hook``,
    the fp16 and bf16 compress hooks), and the average, multiplied back by the world size,
    rounds to the exact sum (``averages_exactly``): one collective fewer per step. It rides
    with torch's ``powerSGD_hook`` too, as one more 1-D gradient, which PowerSGD averages
    uncompressed (``row_in_powersgd``); its error feedback on the row is zeroed before each
    call. Otherwise the row is all-reduced on its own, right after the last bucket's hook
    call, on ``row_group`` (``_launch_row``). A small collective of its own costs a few
    percent of a step on gloo (a transformer step with PowerSGD: 2 to 4%).
    """

    averages = True

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        state: Any,
        hook: CommHook,
        *,
        world_size: int,
        row_may_ride: bool,
        row_group: dist.ProcessGroup | None = None,
    ) -> None:
        """``row_may_ride``: the hook's group is the wrapper's, and the row holds only flags.

        ``row_group``: where the row is all-reduced when it does not ride; None for
        ``group``, the wrapper's. An ordered hook needs a private group with its ranks.
        """
        self.state = state
        self.hook = hook
        self.ordered = launches_from_callbacks(hook)
        if self.ordered and row_group is None:
            raise ValueError("an ordered hook's agreement row needs a group of its own")
        self._sum = AsyncSum(group)
        self._row_sum = self._sum if row_group is None else AsyncSum(row_group)
        self.row_group = self._row_sum.group
        """The process group the row is all-reduced on when it does not ride."""
        self._world = world_size
        self._row_may_ride = row_may_ride
        # The row rides as a gradient of its own, which the hook averages (PowerSGD).
        self._row_as_gradient = row_in_powersgd(hook, state)
        # torch's averaging hooks, run here with no callback (native_hooks.py); else None.
        self._native = native_hook(hook, state)
        self._rides_by_dtype: dict[torch.dtype, bool] = {}
        self.riding = False  # the row rode in the last bucket of the step under way
        # The future of the hook called last in this step: with an ordered hook, the next
        # bucket's call waits for it.
        self._tail: torch.futures.Future[Any] | None = None
        # The row's all-reduce, once launched.
        self._row: dist.Work | None = None

    @property
    def extra_collectives(self) -> int:
        """Collectives per step besides one per bucket: the row's own, unless it rode."""
        return 0 if self.riding else 1

    def _rides(self, storage: torch.Tensor) -> bool:
        """Whether the row rides in a last bucket of ``storage``'s dtype (same on every rank)."""
        rides = self._rides_by_dtype.get(storage.dtype)
        if rides is None:
            wire = averaging_wire(self.hook, storage.dtype)
            if wire is None and self._row_as_gradient:
                wire = storage.dtype
            rides = (
                self._row_may_ride
                and not storage.is_complex()
                and wire is not None
                and averages_exactly(wire, self._world)
            )
            self._rides_by_dtype[storage.dtype] = rides
        return rides

    def launch(self, k: int, bucket: Bucket) -> torch.futures.Future[Any]:
        """Call the hook on bucket ``k`` (with an ordered hook, once bucket ``k - 1``'s
        future is done)."""
        if bucket.row is None:
            return self._call(k, bucket.grads, bucket.params, False, bucket.views_for_hook)
        self.riding = self._rides(bucket.storage)
        if not self.riding:
            if self._row_as_gradient:
                fit_row_error(self.state, k, bucket.grads.numel(), bucket.storage.numel(), False)
            future = self._call(k, bucket.grads, bucket.params, True, bucket.views_for_hook)
        elif self._row_as_gradient:
            future = self._call_with_row(k, bucket, bucket.storage, bucket.views_for_hook)
        else:
            future = self._call(k, bucket.storage, bucket.params, True, bucket.views_for_hook)
        if not self.riding:
            self._launch_row(bucket.row)
        return future

    def _finish_row(self, row: torch.Tensor, check: Callable[[], None], riding: bool) -> None:
        """Run ``check`` (the hooks' results) and leave the ranks' summed row in ``row``.

        A row that rode came back with the hook's results, as the ranks' average: it is
        multiplied back into their sum. Otherwise its own all-reduce is waited for.
        """
        if riding:
            check()
            row.mul_(self._world).round_()
        else:
            self._wait_row(check)

    def _call(
        self,
        k: int,
        buffer: torch.Tensor,
        params: list[torch.Tensor],
        last: bool,
        views: Callable[[], list[torch.Tensor]] | None = None,
    ) -> torch.futures.Future[Any]:
        """Call the hook on bucket ``k``'s ``buffer``; ``views`` makes what its
        ``gradients()`` returns (the bucket's ``views_for_hook``; None: views of ``buffer``
        made if it asks, for a joined rank's stand-ins)."""
        if self._native is not None:
            averaged: Any = self._native(buffer)  # waited for as a hook's future is
            self._tail = averaged
            return averaged
        if views is None:
            views = functools.partial(slot_views, buffer, params)
        bucket = GradBucket(k, buffer, views, params, last)  # type: ignore[arg-type]
        previous = self._tail if self.ordered and k > 0 else None
        if previous is None or previous.done():
            future = run_hook(self.hook, self.state, bucket)
        else:
            call = functools.partial(run_hook, self.hook, self.state, bucket)
            future = call_after(previous, call)
        self._tail = future
        return future

    def _call_with_row(
        self,
        k: int,
        bucket: Bucket,
        storage: torch.Tensor,
        views: Callable[[], list[torch.Tensor]] | None = None,
    ) -> torch.futures.Future[Any]:
        """Call the hook on the last ``bucket``'s ``storage`` (its own, or a joined rank's
        stand-in), with the row as one more 1-D gradient after the parameters' (see
        ``row_in_powersgd``)."""
        numel = bucket.grads.numel()
        fit_row_error(self.state, k, numel, storage.numel(), True)
        row = storage[numel:]
        made = views or functools.partial(slot_views, storage[:numel], bucket.params)
        return self._call(k, storage, bucket.params, True, lambda: [*made(), row])

    def _launch_row(self, row: torch.Tensor) -> None:
        """Launch the row's all-reduce on ``row_group``, right after the last hook call; it
        overlaps the hooks' traffic.

        An unordered hook has launched all its collectives, so the row goes next on the
        wrapper's group on every rank. An ordered one may still launch some from its
        futures' callbacks on the wrapper's group, in an order the row could not keep a
        place in: its row goes on a private group, whose order is its own.
        """
        self._row = self._row_sum(on_wire(row))

    def _wait_row(self, check: Callable[[], None]) -> None:
        """Run ``check`` (the hooks' results), then wait for the row's sum.

        The row is waited for whatever ``check`` raises: every rank launched it.
        """
        launched, self._row = self._row, None
        try:
            check()
        finally:
            wait_kept(launched)

    def wait_all(self, buckets: Sequence[Bucket]) -> None:
        """Wait for every hook's future, copy its result in, and have the row summed."""
        riding = self.riding
        last = buckets[-1]

        def take_results() -> None:
            for bucket in buckets:
                buffer = bucket.storage if riding and bucket is last else bucket.grads
                reduced = hook_result(bucket.wait(), buffer, self.hook)
                if reduced.data_ptr() != buffer.data_ptr():
                    buffer.copy_(reduced.view_as(buffer))

        row = last.row
        assert row is not None
        self._finish_row(row, take_results, riding)

    def reduce_copies(
        self,
        storages: list[torch.Tensor],
        buckets: Sequence[Bucket],
        sparse: SparseGradients | None,
    ) -> None:
        """Run the hook on stand-ins for ``buckets`` (a joined rank's zeros), then the row.

        ``sparse`` is always None: a hook is refused for sparse gradients.
        """
        grads = [s[: b.grads.numel()] for b, s in zip(buckets, storages, strict=True)]
        riding = self._rides(storages[-1])
        if riding:  # the training ranks' last buffer holds the row too
            grads[-1] = storages[-1]
        last = len(grads) - 1
        if self._row_as_gradient and not riding:
            fit_row_error(self.state, last, grads[-1].numel(), storages[-1].numel(), False)
        futures = [
            self._call_with_row(k, b, g)
            if k == last and riding and self._row_as_gradient
            else self._call(k, g, b.params, k == last)
            for k, (g, b) in enumerate(zip(grads, buckets, strict=True))
        ]
        row = storages[-1][buckets[-1].grads.numel() :]

        def check_results() -> None:
            # Checked as on the ranks still training, which raise there too.
            for future, g in zip(futures, grads, strict=True):
                hook_result(future.wait(), g, self.hook)

        if not riding:
            self._launch_row(row)
        self._finish_row(row, check_results, riding)


class CheckedLauncher:
    """Another launcher, behind the finite check: each bucket is checked, then launched."""

    def __init__(self, inner: AllReduceLauncher | HookLauncher, check: FiniteGuard) -> None:
        self.inner = inner
        self._check = check
        self.averages = inner.averages
        self.extra_collectives = inner.extra_collectives

    def launch(self, k: int, bucket: Bucket) -> Any:
        """Check bucket ``k`` (still this rank's gradients), then launch it."""
        self._check.before_launch(k, bucket)
        return self.inner.launch(k, bucket)

    def wait_all(self, buckets: Sequence[Bucket]) -> None:
        """Wait for every bucket, as the inner launcher does."""
        self.inner.wait_all(buckets)

    def reduce_copies(
        self,
        storages: list[torch.Tensor],
        buckets: Sequence[Bucket],
        sparse: SparseGradients | None,
    ) -> None:
        """A joined rank's zeros: nothing to check."""
        self.inner.reduce_copies(storages, buckets, sparse)


def hook_state(launcher: Launcher) -> Any:
    """The registered communication hook's state, or None without a hook."""
    inner = launcher.inner if isinstance(launcher, CheckedLauncher) else launcher
    return inner.state if isinstance(inner, HookLauncher) else None


def checked(r: ReducerState, launcher: AllReduceLauncher | HookLauncher) -> Launcher:
    """``launcher``, behind ``r``'s finite check if it has one."""
    return launcher if r.finite is None else CheckedLauncher(launcher, r.finite)


def hook_launcher(r: ReducerState, state: object, hook: CommHook) -> Launcher:
    """The launcher that reduces each of ``r``'s buckets with ``hook(state, bucket)``.

    Raises unless the hook can be registered now: once per reducer, between steps, and
    for dense gradients only. For a hook that launches collectives from its callbacks it
    makes a process group with ``r``'s ranks, a collective: every rank registers the hook
    at the same point.
    """
    current = r.launcher.inner if isinstance(r.launcher, CheckedLauncher) else r.launcher
    if isinstance(current, HookLauncher):
        raise RuntimeError(
            "a communication hook is already registered; register_comm_hook can be called "
            "once per wrapper (as with torch DDP)"
        )
    if not callable(hook):
        raise TypeError(f"hook must be callable, got {type(hook).__name__}")
    if r.in_backward:
        raise RuntimeError("register_comm_hook cannot be called during a backward pass")
    if r.sparse is not None:
        raise RuntimeError(errors.hook_with_sparse([r.names[i] for i in r.sparse.indices]))
    world = dist.group.WORLD
    # The group the hook reduces over: its state, or PowerSGD's state's group; None: WORLD.
    hook_group = getattr(state, "process_group", None) if row_in_powersgd(hook, state) else state
    hook_group = hook_group if hook_group is not None else world
    same_group = hook_group is (r.process_group if r.process_group is not None else world)
    # An ordered hook's row goes on a group of its own (see HookLauncher._launch_row),
    # made now, on the thread registering the hook: never from a backend's callback.
    row_group = private_copy(r.process_group) if launches_from_callbacks(hook) else None
    launcher = HookLauncher(
        r.process_group,
        state,
        hook,
        world_size=r.world_size,
        row_may_ride=same_group and r.finite is None,
        row_group=row_group,
    )
    return checked(r, launcher)
