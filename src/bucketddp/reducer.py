"""The reducer: gradient hooks, bucket storage and the collectives in flight.

Each trainable parameter gets a post-accumulate-grad hook. When the last gradient of a
bucket arrives, the bucket's all-reduce is launched asynchronously, strictly in plan
order so every rank issues the same collectives in the same sequence. A callback queued
on the autograd engine runs at the end of backward: it settles parameters that got no
gradient, waits for the work, averages, and checks.

The last bucket in plan order carries one extra element per parameter. It is how ranks
agree, without a collective of its own, on which parameters got a gradient anywhere:
for ``find_unused_parameters=False`` it counts the ranks on which a parameter was missing
(any positive count is an error on every rank, never a hang; for a parameter frozen on
every rank, missing means no gradient since the last synced backward, and it is averaged
where any rank had one), for ``True`` it counts the
ranks on which the parameter was used (zero means globally unused: its ``.grad`` is left
untouched, as torch DDP does). After those come one element per parameter of the model,
trainable or not: the ranks on which it requires a gradient. That is how ranks agree on
``requires_grad`` changes made after wrapping (unfreezing a backbone, say): a parameter
frozen on every rank is skipped, one unfrozen on every rank joins the plan at the end of
the first backward that sees it (its gradient for that step is averaged then, in one
extra collective), and one that differs between ranks is an error on every rank. The very
last two elements count the ranks whose module gained parameters after wrapping (see
``module_changed``): any is an error on every rank; and the ranks whose synced buffers no
longer have the shape and dtype the ranks agreed on (see ``BufferLayout``): then the ranks
compare their buffers, and adopt the new layout if every rank has it, or raise on every
rank if not.

Sparse gradients (embeddings with ``sparse=True``) get no slot: each is all-reduced on its
own, in place, just before the last bucket, which waits for them.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from .buckets import BucketPlan, ParamInfo, cap_bytes, plan_buckets
from .comm import AsyncSum, all_reduce_coalesced, on_wire
from .comm_hooks import CommHook, GradBucket, call_after, hook_result, run_hook

log = logging.getLogger(__name__)

# The attribute on each bucket's storage that names the reducer owning it (a weak
# reference): a gradient that is a view into another reducer's bucket tells that two
# wrappers reduce one parameter in the same backward.
_OWNER = "_bucketddp_owner"

_COMPILED_AUTOGRAD = (
    "BucketDataParallel does not support compiled autograd "
    "(torch._dynamo.config.compiled_autograd): its gradient hooks launch collectives and "
    "wait for them outside any graph. Turn compiled autograd off; torch.compile of the "
    "model, inside or outside the wrapper, is supported."
)

NO_TRAINABLE = (
    "BucketDataParallel needs at least one parameter with requires_grad=True, and the module "
    "has none to reduce (those in _ddp_params_and_buffers_to_ignore do not count). Unfreeze "
    "the parameters to train (requires_grad_(True)) before wrapping; a model that only runs "
    "inference needs no wrapper."
)

_CREATE_GRAPH = (
    "parameter {name!r} has a gradient that requires grad: backward(create_graph=True) is not "
    "supported, since the bucket all-reduce cannot carry a gradient's own graph (torch DDP "
    "fails here too). For higher-order terms (a gradient penalty, Hessian-vector products), "
    "take them with torch.autograd.grad(..., create_graph=True) and call backward() on the "
    "final loss without create_graph."
)


def _compiled_autograd() -> bool:
    """Whether this backward runs under compiled autograd, where the hooks cannot work.

    Dynamo traces the hooks there (``is_compiling``). Where it falls back to running one
    eagerly, compiled autograd's own flag tells (a private module attribute, read only if
    that module is loaded). Checked once per backward, at its first hook.
    """
    if torch.compiler.is_compiling():
        return True
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(module, "in_compiled_autograd_region", False))


@dataclass(frozen=True)
class CommStats:
    """Figures of the last synced backward pass."""

    collectives: int = 0
    """All-reduces launched for gradient buckets."""
    bytes_reduced: int = 0
    """Bytes of gradient (and bookkeeping) all-reduced."""
    wait_seconds: float = 0.0
    """Time spent at the end of backward waiting for communication to finish."""
    buckets: int = 0
    """Buckets in the plan used for the step."""


class BufferLayout(Protocol):
    """What the reducer needs of the buffer sync: whether this rank's buffers changed.

    Buffers registered, deleted or reshaped after wrapping must be agreed by every rank
    before the sync can carry them (its collectives would not match otherwise). The change
    travels in the flags of the next synced backward, where every rank calls ``settle``.
    """

    @property
    def deviates(self) -> bool:
        """Whether this rank's buffers may differ from those the ranks last agreed on."""
        ...

    def settle(self) -> str | None:
        """On every rank at once: agree on the buffers anew, or return the error to raise."""
        ...


class _Bucket:
    """Runtime state of one planned bucket."""

    __slots__ = (
        "checked",
        "divisor",
        "expected",
        "flags",
        "grads",
        "members",
        "own",
        "pending",
        "scale",
        "storage",
        "work",
    )

    def __init__(
        self, storage: torch.Tensor, numel: int, members: list[int], riders: int = 0
    ) -> None:
        self.storage = storage
        self.grads = storage[:numel]  # what a communication hook sees
        self.flags: torch.Tensor | None = storage[numel:] if storage.numel() > numel else None
        self.members = members
        # Gradients to wait for before launching: the members', and for the last bucket
        # those of the sparse parameters (``riders``), reduced just before it.
        self.expected = len(members) + riders
        self.pending = self.expected
        # The all-reduce of the storage, or with a communication hook, the hook's future.
        self.work: dist.Work | torch.futures.Future[Any] | None = None
        # How many tensors the reducer itself has on the storage (see _kept_elsewhere), and
        # whether a slot of it was written in this backward yet.
        self.own = 0
        self.checked = False
        # The averaging factors, set by the reducer (see Reducer._set_scales).
        self.scale = self.divisor = torch.ones(())

    def rebind(self, storage: torch.Tensor) -> None:
        """Hold ``storage`` (same size and contents) from now on."""
        numel = self.grads.numel()
        self.storage = storage
        self.grads = storage[:numel]
        self.flags = storage[numel:] if storage.numel() > numel else None

    def wait(self) -> Any:
        """Wait for the bucket's communication; returns what a hook's future holds."""
        value = None
        if self.work is not None:
            value = self.work.wait()
            self.work = None
        return value


class Reducer:
    """Owns the hooks, the bucket storage and the in-flight collectives of one model."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        *,
        process_group: dist.ProcessGroup | None,
        bucket_cap_mb: float,
        first_bucket_mb: float,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        sparse_names: Collection[str] = (),
        static_graph: bool = False,
    ) -> None:
        """``named_params`` is every parameter of the model; those requiring grad are reduced.

        ``sparse_names`` name the parameters whose gradients are sparse (those of
        ``nn.Embedding`` and ``nn.EmbeddingBag`` with ``sparse=True``): they get no bucket
        slot, and each is all-reduced on its own, just before the last bucket.

        ``static_graph``: the graph is the same every step, as torch DDP's option means. A
        parameter may then get several gradients per backward (reentrant checkpoint
        segments sharing it): the first synced backward counts them and reduces everything
        at its end; later ones reduce a parameter at its last gradient. Parameters that get
        none are allowed, as with ``find_unused_parameters``.
        """
        self._all_names = [n for n, _ in named_params]
        self._all_params = [p for _, p in named_params]
        self._sparse_names = frozenset(sparse_names)
        # The sparse gradients of the step in flight: what each sparse parameter sent (its
        # .grad, or an empty tensor where it has none), and the all-reduces.
        self._sparse_sent: list[torch.Tensor] = []
        self._sparse_works: list[dist.Work] = []
        trainable = [j for j, p in enumerate(self._all_params) if p.requires_grad]
        if not trainable:
            raise ValueError(NO_TRAINABLE)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        # The bucket all-reduces, launched from inside backward (see comm.AsyncSum).
        self._all_reduce = AsyncSum(process_group)
        # A static graph may leave parameters unused, as torch DDP allows.
        self.find_unused_parameters = find_unused_parameters or static_graph
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.sync_enabled = True
        # torch DDP's contract: the hooks act only in a backward that follows a grad-enabled
        # forward through the wrapper (``arm``), whose sync decision (``no_sync``) they keep.
        # Gradients from other graphs (the bare module, another wrapper sharing parameters,
        # after the wrapper is gone) accumulate locally, untouched.
        self._armed = False
        self._sync_step = True
        self.stats = CommStats()
        # With one rank there is nothing to reduce: no storage, no copies, hooks only check
        # (unless a communication hook is registered).
        self._communicates = self.world_size > 1
        # Gradients are averaged over ``_divisor`` ranks: the world size, or under
        # ``join(divide_by_initial_world_size=False)`` the ranks still training.
        self._divisor = self.world_size
        # The ranks taking part in the next synced backward with gradients of their own: the
        # world size, or under ``join()`` the ranks still training (see set_training_ranks).
        self._training_ranks = self.world_size
        self._scale = 1.0 / self.world_size
        self._cap_bytes = cap_bytes(bucket_cap_mb)
        self._first_cap_bytes = cap_bytes(first_bucket_mb)
        self._queued = False
        self._from_output = False  # the callback was queued by an output hook
        self._outside_touched = False  # a parameter outside the plan got a gradient
        self._handles: list[RemovableHandle] = []
        # Hooks on parameters outside the plan that a rank saw become trainable: they only
        # make sure the end-of-backward callback runs, where the ranks agree what to do.
        self._watch_handles: dict[int, RemovableHandle] = {}
        # Parameters the module gained or lost after wrapping, as (added, removed) names.
        self._changed: tuple[list[str], list[str]] | None = None
        self._added: list[tuple[str, nn.Parameter]] = []
        self._added_frozen: list[tuple[str, nn.Parameter]] = []
        self._removed: list[str] = []
        self._changed_handles: list[RemovableHandle] = []
        self._comm_hook: tuple[Any, CommHook] | None = None
        # How the unused-parameter error tells the user to allow such parameters; the
        # Lightning strategy names its own option and registered name instead.
        self.unused_hint = "Pass find_unused_parameters=True"
        # The wrapper's buffer sync, whose layout changes travel in the flags.
        self.buffer_layout: BufferLayout | None = None
        # The future of the hook called last in this step: the next bucket's hook waits
        # for it (see comm_hooks.call_after).
        self._hook_tail: torch.futures.Future[Any] | None = None
        self._adopt(trainable)

    def _adopt(self, members: list[int]) -> None:
        """Reduce the parameters at ``members`` (indices into all parameters) from now on.

        Plans them in reverse registration order, to be rebuilt from the next backward's
        ready order, and hooks each of them.
        """
        for h in self._handles:
            h.remove()
        self._members = members
        inside = set(members)
        self._outside = [j for j in range(len(self._all_params)) if j not in inside]
        self._outside_trainable = False
        for j in members:
            handle = self._watch_handles.pop(j, None)
            if handle is not None:
                handle.remove()
        self._names = [self._all_names[j] for j in members]
        self._params = [self._all_params[j] for j in members]
        self._index = {n: i for i, n in enumerate(self._names)}
        self._infos = [
            ParamInfo(n, p.numel(), p.dtype, p.device)
            for n, p in zip(self._names, self._params, strict=True)
        ]
        self._sparse = [i for i, n in enumerate(self._names) if n in self._sparse_names]
        self._is_sparse = [n in self._sparse_names for n in self._names]

        n = len(self._params)
        self._ready = [False] * n  # got its gradient in the current backward
        self._n_ready = 0
        self._used = [False] * n  # got a gradient since the last synced backward
        self._observed: list[int] | None = []  # ready order of the first backward
        self._next = 0  # next bucket to launch, in plan order
        # static_graph: gradients per parameter in this backward, and how many the first
        # synced backward counted (None until then).
        self._fires = [0] * n
        self._expected_fires: list[int] | None = None

        self._install(self._plan())
        # partial (C-implemented) rather than a closure: one Python frame less per parameter
        # per step on the hot path.
        self._handles = [
            _ready_hook(p, functools.partial(self._hook_for(i), i))
            for i, p in enumerate(self._params)
        ]

    def _hook_for(self, i: int) -> Callable[[int, torch.Tensor], None]:
        return self._on_static_ready if self.static_graph else self._on_grad_ready

    def _plan(self, order: Sequence[str] | None = None) -> BucketPlan:
        """Plan the buckets of the dense parameters, in ``order`` if given."""
        dense = [
            info for info, sparse in zip(self._infos, self._is_sparse, strict=True) if not sparse
        ]
        if order is not None and self._sparse:
            order = [n for n in order if n not in self._sparse_names]
        return plan_buckets(
            dense, cap_bytes=self._cap_bytes, first_cap_bytes=self._first_cap_bytes, order=order
        )

    # ----------------------------------------------------------------- plan and storage
    def _install(self, plan: BucketPlan) -> None:
        """Allocate bucket storage for ``plan`` and move any existing gradients into it."""
        n = len(self._params)
        buckets: list[_Bucket] = []
        views: list[torch.Tensor] = [torch.empty(0)] * n
        bucket_of: list[_Bucket] = [None] * n  # type: ignore[list-item]
        # The flags, at the end of the last bucket: one row of them per group of ranks small
        # enough that the bucket's dtype counts it exactly (see _flag_rows).
        width = self._flag_width = n + len(self._all_params) + 2
        rows = _flag_rows(plan[-1].dtype if plan else torch.float32, self.world_size)
        extra = rows * width
        riders = len(self._sparse)
        for k, spec in enumerate(plan if self._communicates else ()):
            is_last = k == len(plan) - 1
            storage = torch.zeros(
                spec.numel + (extra if is_last else 0), dtype=spec.dtype, device=spec.device
            )
            members = [self._index[name] for name in spec.names]
            setattr(storage, _OWNER, weakref.ref(self))
            bucket = _Bucket(storage, spec.numel, members, riders if is_last else 0)
            slots = _slots(storage, [self._params[i] for i in members])
            for i, view in zip(members, slots, strict=True):
                views[i] = view
                bucket_of[i] = bucket
            buckets.append(bucket)
        if self._communicates and riders:
            if not buckets:  # only sparse parameters: a bucket of flags alone
                device = self._params[self._sparse[0]].device
                buckets.append(_Bucket(torch.zeros(extra, device=device), 0, [], riders))
            for i in self._sparse:
                bucket_of[i] = buckets[-1]
        for i, p in enumerate(self._params):
            if p.grad is not None and self._communicates and not self._is_sparse[i]:
                views[i].copy_(p.grad)
                if self.gradient_as_bucket_view:
                    p.grad = views[i]
        self._buckets = buckets
        self._set_scales()
        self._views = views
        # Where each slot's memory starts: a view whose pointer moved was rebound elsewhere.
        self._ptrs = [v.data_ptr() for v in views]
        self._bucket_of = bucket_of
        self.plan = plan
        if buckets:
            flags = self._bind_flags()
            # What the agreement part holds, before and after the sum, when exactly the
            # planned parameters require a gradient on every rank and no module changed.
            # (Built from Python lists: each torch operation that training never calls,
            # indexing say, pages in its code, which counts in the resident memory.)
            inside = set(self._members)
            mask = [float(j in inside) for j in range(len(self._all_params) + 2)]
            world = self.world_size
            self._agreed_summed = torch.tensor(
                [m * world for m in mask], dtype=torch.float64, device=flags.device
            )
            # This rank's row when every planned parameter got its gradient and nothing
            # changed (counts: none missing, or every one used), and with one row, the sum
            # over ranks then: comparing the summed flags with it is the whole check.
            row = [float(self.find_unused_parameters)] * n + mask
            self._row_as_planned = torch.tensor(row, dtype=flags.dtype, device=flags.device)
            self._sum_as_planned = (
                torch.tensor([r * world for r in row], dtype=flags.dtype, device=flags.device)
                if rows == 1
                else None
            )
        self._dense_bytes = sum(_nbytes(b.storage) for b in buckets)
        for bucket in buckets:
            bucket.own = _tensors_on(bucket.storage)
        if self.rank == 0:
            log.debug("bucketddp plan: %s", plan.describe())

    def _set_scales(self) -> None:
        """Give each bucket the averaging factors of the next synced backward.

        They are 0-dim CPU tensors in the bucket's computation dtype (float64 for double
        buckets, float32 otherwise): an operation reads such a tensor as the same scalar as
        a Python float, bit for bit, and skips wrapping a float into a tensor on every call,
        which is half the cost of staging a small gradient.
        """
        for bucket in self._buckets:
            dtype = bucket.storage.dtype
            real = torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32
            bucket.scale = torch.tensor(self._scale, dtype=real)
            bucket.divisor = torch.tensor(float(self._divisor), dtype=real)

    def _bind_flags(self) -> torch.Tensor:
        """Take the flags' views from the last bucket's storage; returns the flags."""
        # The flags' two parts: per planned parameter a count (missing or used ranks), then
        # the agreement part: per model parameter the ranks on which it requires a gradient,
        # then the ranks whose module gained parameters after wrapping, and last the ranks
        # whose synced buffers changed layout.
        flags = self._buckets[-1].flags
        assert flags is not None
        self._flag_table = flags.view(-1, self._flag_width)
        mine = self._flag_table[self.rank % len(self._flag_table)]
        n = len(self._params)
        self._counts, self._agreement = mine[:n], mine[n:]
        return flags

    def _copy_on_write(self, i: int) -> torch.Tensor:
        """Move the kept view of parameter ``i``'s slot to memory of its own; returns a new slot.

        For a ``.grad`` kept from an earlier step (``g = p.grad`` before
        ``zero_grad(set_to_none=True)``): it is a view of the bucket, and writing this
        step's gradient there would change it, where torch DDP gives a fresh tensor after
        ``set_to_none``. The kept tensor object gets a copy of its values (one gradient's
        copy, as torch's fresh tensor costs), and the slot a new view.
        """
        kept = self._views[i]
        kept.data = kept.clone()
        return self._reslot(i)

    def _kept_elsewhere(self, bucket: _Bucket) -> bool:
        """Whether tensors other than the reducer's share ``bucket``'s storage.

        Slot views moved elsewhere by a conversion after wrapping (``.data`` rebound) are
        given new ones first, so that the reducer's own count is exact again.
        """
        for j in bucket.members:
            if self._views[j].data_ptr() != self._ptrs[j]:
                self._reslot(j)
        return _tensors_on(bucket.storage) > bucket.own

    def _move_bucket(self, i: int) -> torch.Tensor:
        """Give parameter ``i``'s bucket new storage, as it is; returns ``i``'s new slot.

        For other tensors on a kept ``.grad``'s memory (``p.grad.view(-1)``,
        ``p.grad.detach()``, ``p.grad.data``), which cannot be moved themselves: they keep
        the old storage, and the bucket moves on (one copy of the bucket).
        """
        bucket = self._bucket_of[i]
        storage = bucket.storage.clone()
        setattr(storage, _OWNER, weakref.ref(self))
        bucket.rebind(storage)
        members = bucket.members
        slots = _slots(storage, [self._params[j] for j in members])
        for j, view in zip(members, slots, strict=True):
            param = self._params[j]
            if param.grad is self._views[j]:  # staged this step, or accumulated in place
                param.grad = view
            self._views[j] = view
            self._ptrs[j] = view.data_ptr()
        del slots
        if bucket.flags is not None:
            self._bind_flags()
        bucket.own = _tensors_on(storage)
        return self._views[i]

    @property
    def all_names(self) -> list[str]:
        """The names of every parameter of the model when it was wrapped."""
        return self._all_names

    @property
    def all_params(self) -> list[nn.Parameter]:
        """Every parameter of the model when it was wrapped, trainable or not."""
        return self._all_params

    @property
    def learned_order(self) -> list[str] | None:
        """The ready order learned from the first backward, or None before it is known."""
        return list(self.plan.order) if self.plan.learned else None

    def load_order(self, order: Sequence[str]) -> bool:
        """Adopt a previously learned order; False (and keep learning) if the params differ."""
        if set(order) != set(self._names) or len(order) != len(self._names):
            return False
        self._install(self._plan(order))
        self._observed = None
        return True

    def _rebuild_from_observed(self) -> None:
        """Replace the initial plan by one built from rank 0's observed ready order."""
        assert self._observed is not None
        # The order spans the no_sync() backward passes before the first synced one, so a
        # parameter may appear in it more than once: the planner keeps first occurrences.
        order = [self._names[i] for i in self._observed]
        self._observed = None
        if self.world_size > 1:
            # Rank 0's order as the planner completes it (every planned parameter once, so
            # the same length on every rank), sent as parameter indices in one tensor.
            full = [self._index[n] for n in self._plan(order).order]
            indices = torch.tensor(full, dtype=torch.int64, device=self._flag_table.device)
            dist.broadcast(indices, src=self._global_rank(0), group=self.process_group)
            order = [self._names[i] for i in indices.tolist()]
        plan = self._plan(order)
        if [b.names for b in plan] == [b.names for b in self.plan]:
            self.plan = plan  # same buckets: keep the storage, remember the order
        else:
            self._install(plan)

    def _global_rank(self, group_rank: int) -> int:
        if self.process_group is None:
            return group_rank
        return dist.get_global_rank(self.process_group, group_rank)

    # ----------------------------------------------------------------------- hooks
    def watch_requires_grad(self) -> None:
        """Before a forward: hook the parameters outside the plan that now require grad.

        Costs nothing when every parameter is in the plan, and one attribute read per frozen
        parameter otherwise. The hook does not reduce anything: it only makes sure the
        end-of-backward callback runs, where the ranks agree on what to do.
        """
        if self._added_frozen and any(p.requires_grad for _, p in self._added_frozen):
            self.module_changed(self._added, self._removed)
        if not self._outside:
            return
        trainable = False
        for j in self._outside:
            p = self._all_params[j]
            if p.requires_grad:
                trainable = True
                if j not in self._watch_handles:
                    self._watch_handles[j] = p.register_post_accumulate_grad_hook(
                        self._on_outside_grad
                    )
        self._outside_trainable = trainable

    def module_changed(
        self, added: Sequence[tuple[str, nn.Parameter]], removed: Sequence[str]
    ) -> None:
        """The module holds ``added`` parameters it did not hold when it was wrapped.

        Every later synced backward raises, on every rank (the change travels in the last
        bucket), until the module is wrapped again (or ``added`` is empty again). ``removed``
        only completes the message: a parameter that left the module gets no gradient, which
        the unused-parameter rules already cover. The added parameters are hooked only to make
        sure such a backward reaches its end-of-backward callback.

        A frozen parameter under a new name is no such change while it stays frozen: it gets
        no gradient, so it cannot train on a rank's own (an EMA copy of the network attached
        in ``on_fit_start``, say). It is checked before each forward, and counts from the
        first one at which it requires a gradient.
        """
        gone = set(removed)
        reported = [n for n, p in added if p.requires_grad or n in gone]
        self._added_frozen = [(n, p) for n, p in added if not p.requires_grad and n not in gone]
        self._added = list(added)
        self._removed = list(removed)
        self._changed = (reported, list(removed)) if reported else None
        for h in self._changed_handles:
            h.remove()
        self._changed_handles = [
            p.register_post_accumulate_grad_hook(self._on_outside_grad)
            for _, p in added
            if p.requires_grad
        ]

    def _on_outside_grad(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        self._outside_touched = True
        if not self._queued:
            self._queue_finalize()

    def on_output_grad(self, grad: torch.Tensor) -> None:
        """A hook for the forward's outputs: their gradient opens the backward pass.

        It runs in the outermost backward, before any parameter's gradient, so the
        end-of-backward callback waits for the whole pass. Queued from a parameter's hook
        instead, it would end with the nested backward of a reentrant checkpoint segment
        if that is where the first gradient came from.
        """
        self._armed = True  # this wrapper's outputs: a second backward through them counts
        if not self._queued:
            self._queue_finalize()
            self._from_output = True

    def arm(self, *, decide: bool = False) -> None:
        """At a grad-enabled forward: the next backward is this reducer's to reduce.

        It syncs unless this forward runs inside ``no_sync()``, the decision torch DDP takes
        at the forward too. A forward inside ``no_sync()`` does not take back the decision
        of a synced one before it (an auxiliary forward), as in torch DDP: the backward
        syncs if any forward since the last one armed it to. Until then, and after a
        backward that reached a parameter, the hooks leave gradients alone. ``decide``
        (``prepare_for_backward``, just before one backward) sets the decision outright.
        """
        keep = not decide and self._armed and self._sync_step
        self._sync_step = self.sync_enabled or keep
        self._armed = True

    def _queue_finalize(self) -> None:
        """At a backward's first hook: have the autograd engine call ``_finalize`` at its end."""
        if _compiled_autograd():
            raise RuntimeError(_COMPILED_AUTOGRAD)
        self._queued = True
        self._from_output = False
        Variable._execution_engine.queue_callback(self._finalize)

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        if self._armed and self._mark_ready(i):
            self._stage(i, param)

    def _stage(self, i: int, param: torch.Tensor) -> None:
        """Put parameter ``i``'s gradient in its bucket slot, then launch what is due.

        A sparse gradient stays in ``.grad``: it is reduced just before the last bucket.
        """
        if not self._is_sparse[i]:
            grad = param.grad
            view = self._fill_slot(i, grad)
            if self.gradient_as_bucket_view and grad is not view:
                param.grad = view
        bucket = self._bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _on_static_ready(self, i: int, param: torch.Tensor) -> None:
        """static_graph: act on parameter ``i``'s last gradient of the backward.

        Until the first synced backward has counted them, and inside ``no_sync``, only the
        first gradient is recorded; ``_reduce`` then fills the slots from ``.grad``.
        """
        if not self._armed:
            return
        fires = self._fires[i] = self._fires[i] + 1
        expected = self._expected_fires
        if expected is None or not self._sync_step:
            if fires == 1:
                self._mark_ready(i)
            return
        if fires < expected[i]:
            if fires == 1:  # used, even if its last gradient never comes (reduced at the end)
                self._used[i] = True
                if not self._queued:
                    self._queue_finalize()
            return
        if fires > expected[i]:
            raise RuntimeError(
                f"parameter {self._names[i]!r} received {fires} gradients in this backward "
                f"pass, but {expected[i]} in the first one; static_graph=True needs the same "
                "graph every step. Pass static_graph=False (and use_reentrant=False to "
                "torch.utils.checkpoint if a parameter is used in several segments)."
            )
        self._on_grad_ready(i, param)

    def _mark_ready(self, i: int) -> bool:
        """Record that parameter ``i`` got its gradient; returns whether to communicate."""
        if not self._queued:
            self._queue_finalize()
        if self._ready[i]:
            raise RuntimeError(
                f"parameter {self._names[i]!r} received a gradient twice in one backward pass; "
                "bucketddp supports one gradient per parameter per backward (a parameter used "
                "in two reentrant checkpoint segments gets one per segment: pass "
                "use_reentrant=False to torch.utils.checkpoint, or static_graph=True to the "
                "wrapper if the graph is the same every step)"
            )
        self._ready[i] = True
        self._n_ready += 1
        self._used[i] = True
        if self._observed is not None:
            self._observed.append(i)
        return self._sync_step and self._communicates

    def _fill_slot(self, i: int, grad: torch.Tensor | None) -> torch.Tensor:
        """Stage gradient ``i`` in its bucket slot, already divided by the world size.

        Averaging here, before the sum, is torch DDP's order, and so is the arithmetic: a
        copied gradient is multiplied by ``1 / world_size`` on its way into the slot (``out=``
        fuses the two; a multiply is also cheaper than a divide), a gradient accumulated in
        place is divided. Returns the slot.
        """
        view = self._views[i]
        if view.data_ptr() != self._ptrs[i]:
            # The slot's tensor object holds other memory now: a conversion after wrapping
            # (model.to(memory_format=...), .double()) sets the ``.data`` of every gradient,
            # and the view was one. The slot gets a new view; a gradient that is still the
            # old object is copied in from there.
            view = self._reslot(i)
        bucket = self._bucket_of[i]
        first = not bucket.checked  # the bucket's first slot written in this backward
        bucket.checked = True
        if grad is view:
            if self._comm_hook is None:  # a hook averages for itself
                view.div_(bucket.divisor)  # accumulated in place, in the slot
            return view
        if sys.getrefcount(view) > _SOLE_REFS:
            # Someone kept this slot's view, the .grad of an earlier step: writing here
            # would change what they hold.
            view = self._copy_on_write(i)
        if first and self._kept_elsewhere(bucket):
            # Someone kept another tensor on the bucket's memory from an earlier step.
            # (One taken later in this backward shares the gradient as with torch DDP.)
            view = self._move_bucket(i)
        if grad is None:
            view.zero_()
            return view
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"parameter {self._names[i]!r} has a {grad.layout} gradient, but its module "
                "did not have sparse=True when it was wrapped; set sparse=True on the "
                "nn.Embedding or nn.EmbeddingBag before wrapping (or wrap it again)"
            )
        base = grad._base
        if base is not None:
            self._check_not_staged_elsewhere(i, base)
        if grad.dtype != view.dtype:
            raise RuntimeError(
                f"parameter {self._names[i]!r} now has a {grad.dtype} gradient, but it was "
                f"{view.dtype} when the module was wrapped and its bucket holds {view.dtype}. "
                "Convert the module (.to(dtype), .double(), .half()) before wrapping it, or "
                "wrap it again after converting."
            )
        try:
            torch.mul(grad, bucket.scale, out=view)
        except RuntimeError:
            if grad.requires_grad:
                raise RuntimeError(_CREATE_GRAPH.format(name=self._names[i])) from None
            raise
        return view

    def _reslot(self, i: int) -> torch.Tensor:
        """A new view of parameter ``i``'s bucket slot, in the parameter's current layout."""
        bucket = self._bucket_of[i]
        offset = 0
        for j in bucket.members:
            if j == i:
                break
            offset += self._params[j].numel()
        param = self._params[i]
        view = _slots(bucket.storage[offset : offset + param.numel()], [param])[0]
        self._views[i] = view
        self._ptrs[i] = view.data_ptr()
        return view

    def _check_not_staged_elsewhere(self, i: int, base: torch.Tensor) -> None:
        """Raise if another reducer staged parameter ``i``'s gradient in this backward.

        That happens when two wrappers hold the parameter and both ran a forward this
        backward reaches: the gradient would be averaged twice.
        """
        ref = getattr(base, _OWNER, None)
        owner = ref() if ref is not None else None
        if owner is not None and owner is not self and owner._queued:
            raise RuntimeError(
                f"parameter {self._names[i]!r} is reduced by two BucketDataParallel wrappers "
                "in this backward pass: both hold it, and both ran a forward since their last "
                "backward. Reduce each parameter with one wrapper per backward: wrap one "
                "module that holds every part (an nn.ModuleDict, say), or run each wrapper's "
                "forward and backward in turn."
            )

    def _launch_ready(self) -> None:
        """Launch every bucket whose turn has come, in plan order."""
        buckets = self._buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            bucket = buckets[self._next]
            if bucket.flags is not None:
                if self._sparse:
                    self._launch_sparse()
                self._write_flags()
            if self._comm_hook is None:
                bucket.work = self._all_reduce(on_wire(bucket.storage))
            else:
                self._launch_hook(bucket)
            self._next += 1

    def _launch_sparse(self) -> None:
        """All-reduce each sparse gradient, averaged, in place; an empty one where none.

        A sparse parameter with no gradient here since the last synced backward (unused, or
        frozen) sends an empty one, so that every rank launches the same collectives; a
        ``.grad`` left from earlier steps is not sent, nor changed.
        """
        self._sparse_sent = []
        self._sparse_works = []
        for i in self._sparse:
            grad = self._params[i].grad if self._used[i] else None
            if grad is None:
                grad = _empty_sparse(self._params[i])
            else:
                grad.div_(self._divisor)  # torch DDP's arithmetic for sparse gradients
            self._sparse_sent.append(grad)
            self._sparse_works.append(
                dist.all_reduce(grad, group=self.process_group, async_op=True)
            )

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket's gradients with ``hook(state, bucket)`` from the next step on."""
        if self._comm_hook is not None:
            raise RuntimeError(
                "a communication hook is already registered; register_comm_hook can be called "
                "once per wrapper (as with torch DDP)"
            )
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        if self._queued:
            raise RuntimeError("register_comm_hook cannot be called during a backward pass")
        if self._sparse:
            raise RuntimeError(
                "register_comm_hook: parameters "
                f"{_first_names([self._names[i] for i in self._sparse])} have sparse gradients "
                "(sparse=True), which bucketddp all-reduces itself; communication hooks are "
                "supported for dense gradients only. Build the embeddings with sparse=False to "
                "use a hook."
            )
        self._comm_hook = (state, hook)
        self._scale = 1.0  # slots hold plain gradients: the hook averages
        self._set_scales()
        if not self._communicates:
            # One rank: buckets exist only to hand the hook its gradients, as torch DDP does
            # (so a compressing hook rounds them there too).
            self._communicates = True
            self._install(self.plan)

    def set_divisor(self, ranks: int) -> None:
        """Average the next synced backward's gradients over ``ranks`` ranks.

        The world size by default; fewer while some ranks have joined (uneven inputs, with
        ``divide_by_initial_world_size=False``). A communication hook averages for itself.
        """
        if ranks == self._divisor:
            return  # called every iteration under join(): the factors stand
        self._divisor = ranks
        if self._comm_hook is None:
            self._scale = 1.0 / ranks
        self._set_scales()

    def set_training_ranks(self, ranks: int) -> None:
        """How many ranks send gradients in the next synced backward (fewer under ``join()``)."""
        self._training_ranks = ranks

    def _launch_hook(self, bucket: _Bucket) -> None:
        # Views of its own for the hook's GradBucket: one it keeps must not hold the slots'
        # views, which would look like a .grad kept by the user (see _fill_slot).
        bucket.work = self._call_hook(self._next, bucket.grads)

    def _call_hook(
        self, k: int, grads: torch.Tensor, views: list[torch.Tensor] | None = None
    ) -> torch.futures.Future[Any]:
        """Call the communication hook on bucket ``k``'s gradients, held in ``grads``.

        Bucket 0's hook is called now; bucket ``k``'s once bucket ``k - 1``'s future is done,
        so that collectives a hook launches from its callbacks keep one order on every rank.
        """
        assert self._comm_hook is not None
        state, hook = self._comm_hook
        params = [self._params[i] for i in self._buckets[k].members]
        if views is None:
            views = _slots(grads, params)
        bucket = GradBucket(k, grads, views, params, k == len(self._buckets) - 1)
        previous = self._hook_tail if k > 0 else None
        if previous is None or previous.done():
            future = run_hook(hook, state, bucket)
        else:
            future = call_after(previous, functools.partial(run_hook, hook, state, bucket))
        self._hook_tail = future
        return future

    def _write_flags(self) -> None:
        n = len(self._params)
        counts, agreement = self._counts, self._agreement
        if len(self._flag_table) > 1:
            self._flag_table.zero_()  # the other rows: last step's sums
        if (
            self._n_ready == n
            and not self._outside_trainable
            and self._changed is None
            and not self._buffers_deviate()
        ):
            # Every planned parameter got a gradient (so it is used, and requires one), and
            # nothing else does: the row as planned, in one copy.
            self._flag_table[self.rank % len(self._flag_table)].copy_(self._row_as_planned)
            return
        if self.find_unused_parameters:
            if all(self._used):
                counts.fill_(1)
            else:
                counts.copy_(torch.tensor(self._used, dtype=counts.dtype))
        elif self._n_ready == n:
            counts.zero_()
        else:
            # Missing: no gradient in this backward. A parameter frozen here is missing only
            # if it got none since the last synced backward either: one frozen between the
            # micro-batches of no_sync() holds a gradient that is averaged like any other.
            missing = [
                not (ready or (used and not p.requires_grad))
                for ready, used, p in zip(self._ready, self._used, self._params, strict=True)
            ]
            counts.copy_(torch.tensor(missing, dtype=counts.dtype))
        self._write_local_agreement(agreement)

    def _write_local_agreement(self, agreement: torch.Tensor) -> None:
        """This rank's agreement part: requires_grad per model parameter, then two changes."""
        local = [p.requires_grad for p in self._all_params]
        changes = [self._changed is not None, self._buffers_deviate()]
        agreement.copy_(torch.tensor([*local, *changes], dtype=agreement.dtype))

    def _buffers_deviate(self) -> bool:
        return self.buffer_layout is not None and self.buffer_layout.deviates

    # --------------------------------------------------------------- end of backward
    def _finalize(self) -> None:
        """Runs once at the end of each backward pass that touched a parameter."""
        node = torch._C._current_autograd_node()
        if node is not None and not self._from_output and self._n_ready < len(self._ready):
            # The end of a backward nested in another (a reentrant checkpoint segment's)
            # while gradients may still come: a parameter's hook queued the callback there,
            # as no output hook did in the outer one (the forward returned an object the
            # hooks do not look into). Finish at the end of the enclosing backward instead.
            # (Queued by an output hook, the nested backward went through the whole
            # forward, recomputed inside it: ``checkpoint(model, x)``. It ends the step.)
            node.register_hook(_Once(self._requeue_finalize))
            return
        self._queued = False
        touched = self._touched()
        if touched and node is None:
            # Until the next forward (or a backward through its outputs). Not at the end of a
            # backward nested in another (a reentrant checkpoint segment's, when no output
            # hook queued this callback in the outer one): the outer one's gradients follow.
            self._armed = False
        if not self._sync_step or not touched:
            self._reset_step()
            return
        try:
            error, joined = self._reduce() if self._communicates else self._check_local()
        finally:
            self._reset_step()
            self._used = [False] * len(self._used)
        if error is not None:
            raise RuntimeError(error)
        if joined:
            self._adopt(sorted(self._members + joined))
            log.info(
                "bucketddp: %d parameter(s) now require a gradient on every rank and join the "
                "buckets: %s",
                len(joined),
                [self._all_names[j] for j in joined][:10],
            )
        elif self._observed is not None:
            self._rebuild_from_observed()

    def _requeue_finalize(self) -> None:
        """After the node that ran a nested backward: ``_finalize`` at the outer one's end."""
        Variable._execution_engine.queue_callback(self._finalize)

    def _touched(self) -> bool:
        """Whether a parameter of the module got a gradient in this backward pass.

        None did in ``torch.autograd.grad`` (a gradient penalty's, say), which accumulates
        nothing into ``.grad``: there is nothing to reduce, as with torch DDP. The output
        hooks queue the callback all the same; it then does nothing.
        """
        return (
            self._n_ready > 0 or self._outside_touched or (self.static_graph and any(self._fires))
        )

    def _check_local(self) -> tuple[str | None, list[int]]:
        """World size 1: nothing to reduce, only the unused-parameter contract to keep."""
        if self._changed is not None:
            return self._changed_message(1), []
        joined = [j for j in self._outside if self._all_params[j].requires_grad]
        if self.find_unused_parameters or self._n_ready == len(self._ready):
            return None, joined
        missing = [
            not r and p.requires_grad for r, p in zip(self._ready, self._params, strict=True)
        ]
        return (self._missing_message(missing) if any(missing) else None), joined

    def _reduce(self) -> tuple[str | None, list[int]]:
        """Launch what is left, wait for everything and check; returns (error, joining params)."""
        if self.static_graph and self._expected_fires is None:
            self._fill_counted()
        locally_missing: list[int] = []
        if self._n_ready < len(self._ready):
            locally_missing = [i for i, r in enumerate(self._ready) if not r]
        for i in locally_missing:
            if not self._is_sparse[i]:
                self._fill_slot(i, self._params[i].grad)
            self._bucket_of[i].pending -= 1
        self._launch_ready()

        start = time.perf_counter()
        for work in self._sparse_works:
            work.wait()
        for bucket in self._buckets:
            value = bucket.wait()
            if self._comm_hook is not None:
                reduced = hook_result(value, bucket.grads, self._comm_hook[1])
                if reduced.data_ptr() != bucket.grads.data_ptr():
                    bucket.grads.copy_(reduced.view_as(bucket.grads))
        if self._comm_hook is not None:
            # The hook left the flags alone; they travel now, after every hook's future is
            # done. A hook may launch collectives from its futures' callbacks (PowerSGD
            # does), on another thread: launching this one earlier could order it
            # differently on different ranks.
            flags = self._buckets[-1].flags
            assert flags is not None
            dist.all_reduce(flags, group=self.process_group)
        waited = time.perf_counter() - start
        self.stats = CommStats(
            collectives=len(self._buckets) + len(self._sparse) + (self._comm_hook is not None),
            bytes_reduced=self._dense_bytes + sum(_nbytes(g) for g in self._sparse_sent),
            wait_seconds=waited,
            buckets=len(self._buckets),
        )

        expected = self._sum_as_planned
        if expected is not None and torch.equal(self._flag_table[0], expected):
            # The common step, told by one comparison: on every rank every planned parameter
            # got its gradient and nothing changed (so nothing is missing here either).
            if not self.find_unused_parameters and not self.gradient_as_bucket_view:
                self._copy_back()
            elif self.find_unused_parameters:
                self._take_used([True] * len(self._params), locally_missing)
            return None, []
        counts, agreement = self._read_flags(self._flag_table)
        error, frozen, joined = self._check_flags(counts, agreement, bool(locally_missing))
        if error is not None:
            return error, []
        if not self.find_unused_parameters:
            take = None
            if frozen is not None:
                # Frozen everywhere: .grad untouched, unless some rank got a gradient for it
                # since the last synced backward (inside no_sync, before freezing it): then
                # it takes the average, as a used parameter does. A rank that has joined
                # (uneven inputs) counts in neither: it sends no gradient and no flag.
                missed = counts.tolist()
                ranks = self._training_ranks
                take = [not f or c < ranks for f, c in zip(frozen, missed, strict=True)]
            if not self.gradient_as_bucket_view:
                self._copy_back(take)
            elif take is not None:
                self._take_views([i for i in locally_missing if take[i]])
        else:
            # A parameter frozen everywhere counts as unused everywhere: grad untouched.
            self._take_used([c > 0 for c in counts.tolist()], locally_missing)
        if joined:
            return self._reduce_joined(joined), joined
        return None, []

    def _take_used(self, used_anywhere: list[bool], locally_missing: list[int]) -> None:
        """find_unused_parameters: give each parameter used on some rank the averaged gradient.

        A parameter unused here but used elsewhere takes it too; one unused everywhere keeps
        its ``.grad`` untouched.
        """
        if self.gradient_as_bucket_view:
            self._take_views([i for i in locally_missing if used_anywhere[i]])
        else:
            self._copy_back(used_anywhere)
        for i, sent in zip(self._sparse, self._sparse_sent, strict=True):
            if used_anywhere[i] and self._params[i].grad is not sent:
                self._params[i].grad = sent  # unused here: the others' average

    def _take_views(self, indices: list[int]) -> None:
        """Point the ``.grad`` of the dense parameters at ``indices`` at their averaged slots."""
        for i in indices:
            if not self._is_sparse[i] and self._params[i].grad is not self._views[i]:
                self._params[i].grad = self._views[i]

    def _fill_counted(self) -> None:
        """static_graph, first synced backward: stage every gradient now, and keep the counts.

        Its hooks only counted gradients, since a parameter's last one could not be told
        apart from the others until the end.
        """
        for i, p in enumerate(self._params):
            if self._ready[i]:
                self._stage(i, p)
        self._expected_fires = list(self._fires)

    def _read_flags(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed flags, rows added up in float64: (counts, agreement)."""
        total = _summed(table).sum(0)
        n = len(self._params)
        return total[:n], total[n:]

    def _check_flags(
        self, counts: torch.Tensor, agreement: torch.Tensor, missing_here: bool
    ) -> tuple[str | None, list[bool] | None, list[int]]:
        """Read the summed flags; returns (error, frozen, joining parameters).

        ``frozen`` is per planned parameter, frozen on every rank (None when every planned
        parameter requires a gradient everywhere); joining parameters are outside the plan
        and now require a gradient on every rank.
        """
        frozen: list[bool] | None = None
        joined: list[int] = []
        if not torch.equal(agreement, self._agreed_summed):
            *ranks, changed, buffers = [round(c) for c in agreement.tolist()]
            if changed:
                return self._changed_message(changed), None, []
            if buffers and self.buffer_layout is not None:
                # Every rank is here, having read the same sum: they compare buffers now.
                error = self.buffer_layout.settle()
                if error is not None:
                    return error, None, []
            differ = [j for j, c in enumerate(ranks) if 0 < c < self.world_size]
            if differ:
                return self._differ_message(differ, ranks), None, []
            frozen = [ranks[j] == 0 for j in self._members]
            joined = [j for j in self._outside if ranks[j] == self.world_size]
        if not self.find_unused_parameters and (missing_here or bool(counts.any())):
            missing = [c > 0 for c in counts.tolist()]
            if frozen is not None:
                missing = [m and not f for m, f in zip(missing, frozen, strict=True)]
            if any(missing):
                return self._missing_message(missing), None, []
        return None, frozen, joined

    def shadow_backward(self) -> None:
        """On a rank that has joined (uneven inputs), match one synced backward of the others.

        The rank contributes zeros to every bucket's collective, in plan order (through the
        communication hook if one is registered), and its own requires_grad flags, so the
        others average the gradients of the ranks still training. It reads the summed flags
        as they do, so an error they raise is raised here too, and it takes part in the
        bucket rebuild after the first synced backward. Its own ``.grad`` is left alone.
        """
        if not self._communicates:
            return
        storages = [torch.zeros_like(b.storage) for b in self._buckets]
        n = len(self._params)
        last = self._buckets[-1]
        flags = storages[-1][last.grads.numel() :]
        table = flags.view(len(self._flag_table), -1)
        self._write_local_agreement(table[self.rank % len(table)][n:])
        if self._comm_hook is None:
            # The sparse gradients' all-reduces come just before the last bucket's.
            sparse = [_empty_sparse(self._params[i]) for i in self._sparse]
            works = [
                dist.all_reduce(t, group=self.process_group, async_op=True)
                for t in [*storages[:-1], *sparse, storages[-1]]
            ]
            for work in works:
                work.wait()
        else:
            grads = [s[: b.grads.numel()] for b, s in zip(self._buckets, storages, strict=True)]
            futures = [self._call_hook(k, g) for k, g in enumerate(grads)]
            for future, g in zip(futures, grads, strict=True):
                # Checked as on the ranks still training, which raise before the flags'
                # all-reduce: this rank must not reach it alone.
                hook_result(future.wait(), g, self._comm_hook[1])
            dist.all_reduce(flags, group=self.process_group)
        error, _, joined = self._check_flags(*self._read_flags(table), False)
        if error is None and joined:
            # Parameters now trainable on every rank (this one unfroze them before joining):
            # match the extra all-reduce of the others, contributing nothing, and adopt them.
            error = self._reduce_joined(joined, contribute=False)
        if error is not None:
            raise RuntimeError(error)
        if joined:
            self._adopt(sorted(self._members + joined))
        elif self._observed is not None:
            self._rebuild_from_observed()

    def _reduce_joined(self, joined: list[int], contribute: bool = True) -> str | None:
        """Average the gradients of parameters that just became trainable on every rank.

        They have no bucket slot yet, so they travel in one extra all-reduce per dtype,
        each with one more element counting the ranks that produced a gradient for it. A
        parameter no rank produced a gradient for keeps ``.grad`` untouched. A rank that has
        joined (uneven inputs) takes part with ``contribute=False``: zeros, no gradient, and
        its own ``.grad`` left alone.
        """
        sparse = [self._all_names[j] for j in joined if self._all_names[j] in self._sparse_names]
        if sparse:
            return (
                f"parameters {_first_names(sparse)} have sparse gradients and became "
                "trainable after the model was wrapped; bucketddp plans sparse parameters when "
                "it wraps the model. Unfreeze them before wrapping, or wrap the model again "
                "after unfreezing them."
            )
        params = [self._all_params[j] for j in joined]
        grads = [p.grad if contribute else None for p in params]
        averages = [
            torch.mul(g, 1.0 / self._divisor) if g is not None else torch.zeros_like(p)
            for p, g in zip(params, grads, strict=True)
        ]
        # Per parameter: the ranks that produced a gradient, and those still training that
        # did not (a joined rank counts in neither).
        counts = [
            torch.tensor(
                [float(g is not None), float(contribute and g is None)],
                dtype=p.dtype,
                device=p.device,
            )
            for p, g in zip(params, grads, strict=True)
        ]
        all_reduce_coalesced([*averages, *counts], dist.ReduceOp.SUM, self.process_group)
        missing: list[str] = []
        for j, p, avg, summed in zip(joined, params, averages, counts, strict=True):
            produced, missed = summed.tolist()
            if produced == 0:
                continue
            if missed > 0 and not self.find_unused_parameters:
                missing.append(self._all_names[j])
            elif not contribute:
                continue
            elif p.grad is None:
                p.grad = avg
            else:
                p.grad.copy_(avg)
        if missing:
            return self._missing_message_for(missing)
        return None

    def _copy_back(self, take: list[bool] | None = None) -> None:
        """gradient_as_bucket_view=False: write the averages into the .grad tensors.

        ``take`` (per planned parameter) leaves out the globally unused or frozen ones,
        whose ``.grad`` stays untouched, as torch DDP does.
        """
        for i, p in enumerate(self._params):
            if (take is not None and not take[i]) or self._is_sparse[i]:
                continue
            if p.grad is None:
                p.grad = self._views[i].clone()
            else:
                p.grad.copy_(self._views[i])

    def _missing_message(self, missing_flags: list[bool]) -> str:
        return self._missing_message_for(
            [n for n, m in zip(self._names, missing_flags, strict=True) if m]
        )

    def _missing_message_for(self, missing: list[str]) -> str:
        shown = missing[:10] + (["..."] if len(missing) > 10 else [])
        return (
            f"BucketDataParallel: parameters {shown} received no gradient in this backward "
            f"pass on at least one rank, so their gradients cannot be reduced. "
            f"{self.unused_hint}, or make every parameter contribute to the loss on every "
            "rank."
        )

    def _changed_message(self, ranks: int) -> str:
        where = f"on {ranks} of {self.world_size} ranks"
        if self._changed is None:
            what = "(none on this rank)"
        else:
            added, removed = self._changed
            replaced = [n for n in added if n in removed]
            parts = [
                f"{label} {_first_names(names)}"
                for label, names in (
                    ("replaced", replaced),
                    ("added", [n for n in added if n not in replaced]),
                    ("removed", [n for n in removed if n not in replaced]),
                )
                if names
            ]
            what = "(here: " + "; ".join(parts) + ")"
        return (
            f"BucketDataParallel: the wrapped module gained parameters after wrapping, {where} "
            f"{what}. The wrapper reduces the Parameter objects the module held when it was "
            "wrapped, so a new one would train on each rank's own gradient. Add or replace layers, "
            "call load_state_dict(assign=True) or apply weight_norm before wrapping, or wrap "
            "the module again afterwards; to load weights into a wrapped module, use "
            "load_state_dict without assign=True, which copies in place."
        )

    def _differ_message(self, differ: list[int], ranks: list[int]) -> str:
        shown = [f"{self._all_names[j]} ({ranks[j]} of {self.world_size})" for j in differ[:10]]
        more = ", ..." if len(differ) > 10 else ""
        return (
            "BucketDataParallel: requires_grad differs between ranks for parameters "
            f"{', '.join(shown)}{more} (figures: ranks on which it requires a gradient). "
            "Freeze and unfreeze parameters alike on every rank, before the same forward."
        )

    @property
    def step_unfinished(self) -> bool:
        """A backward pass started but never reached its end (it raised midway).

        Not while that backward is still running: a forward inside it (the recomputation of
        ``checkpoint(model, x)``) belongs to it.
        """
        return self._queued and torch._C._current_graph_task_id() == -1

    def discard_step(self) -> None:
        """Forget a backward pass that raised midway, so the next one starts clean.

        Collectives it already launched are waited for first, so that they cannot write
        into bucket storage the next step is filling. Every rank that launched them is
        matched by the others: ranks that failed at the same point launched the same ones,
        and ranks that finished their backward launched all of them.
        """
        log.warning(
            "bucketddp: the previous backward pass did not finish (it raised); its partial "
            "gradient reduction is discarded"
        )
        self._queued = False
        for work in self._sparse_works:
            work.wait()
        for bucket in self._buckets:
            bucket.wait()
        self._reset_step()
        self._used = [False] * len(self._used)

    def _reset_step(self) -> None:
        n = len(self._ready)
        self._ready = [False] * n
        self._n_ready = 0
        self._next = 0
        if self.static_graph:
            self._fires = [0] * n
        self._sparse_sent = []
        self._sparse_works = []
        self._outside_touched = False
        for bucket in self._buckets:
            bucket.pending = bucket.expected
            bucket.checked = False

    def remove(self) -> None:
        """Detach the hooks; the parameters keep their current gradients."""
        for h in [*self._handles, *self._watch_handles.values(), *self._changed_handles]:
            h.remove()
        self._handles = []
        self._watch_handles = {}
        self._changed_handles = []


class _Once:
    """A node post-hook that calls ``fn()`` the first time it runs, and never again."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn

    def __call__(self, *_: Any) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


def _ready_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
    """Have ``hook(param)`` run after each gradient is accumulated into ``param``.

    Also for a parameter that is frozen right now: a member of the plan frozen after it
    joined (when parameters unfrozen on every rank join the plan, the others are hooked
    anew). torch refuses the registration on a tensor that does not require a gradient,
    so ``requires_grad`` is set for the registration and cleared again; the hook stays,
    and runs once the parameter is unfrozen.
    """
    if param.requires_grad:
        return param.register_post_accumulate_grad_hook(hook)
    param.requires_grad_(True)
    try:
        return param.register_post_accumulate_grad_hook(hook)
    finally:
        param.requires_grad_(False)


def _flag_rows(dtype: torch.dtype, world_size: int) -> int:
    """How many rows of flags a bucket of ``dtype`` needs to count ``world_size`` ranks.

    The flags are sums of ones over ranks, and a float counts exactly only up to 2 / eps
    (256 in bfloat16, 2048 in float16): beyond, rank ``r`` writes its flags in row
    ``r % rows``, and the rows are added up in float64 after the all-reduce.
    """
    real = dtype.to_real() if dtype.is_complex else dtype
    exact = int(2 / torch.finfo(real).eps)
    return -(-world_size // exact)


def _summed(flags: torch.Tensor) -> torch.Tensor:
    """``flags`` as float64 (the real part of complex ones), to read sums of counts."""
    return (flags.real if flags.is_complex() else flags).to(torch.float64)


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _tensors_on(storage: torch.Tensor) -> int:
    """How many tensors (and storage handles) share ``storage``'s memory; 0 if unknown."""
    if _use_count is None:
        return 0
    return int(_use_count(storage.untyped_storage()._cdata))


def _sole_refs() -> int:
    """What ``sys.getrefcount`` gives in ``_fill_slot`` for a slot view nobody else holds.

    Measured the way ``_fill_slot`` reads it (a list element bound to a local), so that the
    figure holds on any Python version.
    """
    held = [torch.empty(0)]
    view = held[0]
    return sys.getrefcount(view)


_SOLE_REFS = _sole_refs()


def _slots(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat``, one per parameter in order, each shaped like its parameter.

    A parameter whose elements are dense in another order (``channels_last``, a transposed
    weight) gets a view with its own strides, as torch DDP's bucket views do. A gradient
    made a view then keeps the parameter's layout, which AccumulateGrad expects (otherwise
    it warns that the gradient layout contract is broken, and accumulates more slowly).
    """
    views, offset = [], 0
    for p in params:
        if not p.is_contiguous() and _dense(p):
            views.append(flat.as_strided(p.shape, p.stride(), flat.storage_offset() + offset))
        else:
            views.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive places, in some dim order."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _empty_sparse(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient for ``param`` (an embedding's weight) with no rows: it adds nothing."""
    indices = torch.empty(1, 0, dtype=torch.long, device=param.device)
    values = torch.empty(0, *param.shape[1:], dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=False)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor puts on the wire: a sparse one's indices and values."""
    if t.layout == torch.sparse_coo:
        return _nbytes(t._indices()) + _nbytes(t._values())
    return t.numel() * t.element_size()


def _first_names(names: list[str], limit: int = 10) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")
