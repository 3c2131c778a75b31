"""BucketDataParallel: a drop-in for torch's DistributedDataParallel in a hand-written loop."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from . import _structure
from .buckets import BucketPlan
from .buffers import BufferSync, Policy
from .comm import broadcast_coalesced, module_device, verify_same_model
from .comm_hooks import CommHook
from .faults import PROGRESS, release, watch
from .faults.progress import BUFFER_SYNC, FORWARD, USER_CODE
from .forward_io import hook_outputs, output_hook, refuse_dist_autograd, to_device
from .join import JoinableWrapper, training_step
from .module_checks import (
    check_initialized,
    check_wrappable,
    ignored_names,
    model_signature,
    parameter_changes,
    set_ignored,
    sparse_parameters,
)
from .options import DEFAULT_STALL_TIMEOUT, EngineOptions, ForwardSyncSwitch
from .placement import input_device, reduce_group
from .reducer import NO_TRAINABLE, CommStats, Reducer
from .reducer.launch import hook_state
from .reducer.order import learned_order
from .reducer.recovery import discard_step, step_unfinished
from .syncbn import separate_group

log = logging.getLogger(__name__)

NOT_COPYABLE = (
    "a BucketDataParallel on its own process group (or device_mesh) cannot be copied or "
    "pickled, as with torch DDP: only the default group can be found again in the copy. "
    "Copy model.module instead and wrap the copy."
)
NO_GROUP_TO_LOAD = (
    "loading a pickled BucketDataParallel needs the default process group: call "
    "torch.distributed.init_process_group() first, or save model.module instead"
)


class BucketDataParallel(nn.Module, JoinableWrapper):
    """Data-parallel training with a bucketed gradient reducer that overlaps backward.

    Wrap a module exactly as you would with ``torch.nn.parallel.DistributedDataParallel``:
    the gradients after ``backward()`` are the average over ranks, the parameters and
    buffers start from rank 0's values, and ``state_dict()`` keys carry a ``module.``
    prefix. Parameters may be frozen or unfrozen after wrapping, alike on every rank; the
    reducer follows (see ``docs/frozen-parameters.md``). The keywords not listed below are
    the engine options, torch DDP's and bucketddp's own, described in ``docs/engine.md``.

    Args:
        module: the model, already on its device; the same model on every rank.
        process_group: the group to reduce over; the default group if None.
        device_ids: torch DDP's argument, for a module on one accelerator: ``[local_rank]``
            or ``[device]``, naming the module's own device. Tensors in the forward's
            arguments are then moved to it, as torch DDP does. None (the default) or ``[]``
            for a CPU module.
        output_device: torch DDP's argument: None, or the device of ``device_ids``.
        device_mesh: a one-dimensional ``DeviceMesh`` to reduce over, instead of
            ``process_group``.
        options: the engine options as one ``EngineOptions`` (as ``BucketDDP`` passes
            them) instead of as keywords, which are then left at their defaults.

    Raises:
        RuntimeError: when no process group is initialized, the ranks' models differ, or
            the module has lazy or meta parameters.
        TypeError: ``module`` is not an ``nn.Module``, ``process_group`` not a group, a
            bucket size not a number, ``_ddp_params_and_buffers_to_ignore`` a string, or
            ``options`` given with an engine keyword.
        ValueError: ``module`` is or holds a data-parallel wrapper, or has no parameter
            that requires a gradient; on bad bucket sizes or buffer policies, buffer options
            that contradict each other, ``device_ids`` and ``output_device`` that do not
            name the module's one accelerator, or a ``device_mesh`` given with a
            ``process_group`` or with more than one dimension.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str | None = 25.0,
        first_bucket_mb: float | str | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        broadcast_buffers: bool | None = None,
        buffer_sync: Mapping[str, Policy] | None = None,
        default_buffer_policy: Policy | None = None,
        device_ids: Sequence[int | str | torch.device] | None = None,
        output_device: int | str | torch.device | None = None,
        static_graph: bool = False,
        init_sync: bool = True,
        forward_sync_buffers: bool | None = None,
        check_finite: bool = False,
        telemetry: bool = True,
        watchdog: bool = True,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
        device_mesh: Any = None,
        options: EngineOptions | None = None,
    ) -> None:
        check_wrappable(module, BucketDataParallel)
        options = EngineOptions.from_arguments(locals(), options)
        super().__init__()
        Joinable.__init__(self)
        self.options = options
        self._divide_by_initial_world_size = True
        self._input_device = input_device(
            {p.device for p in module.parameters()}, device_ids, output_device
        )
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "BucketDataParallel needs a process group: call "
                "torch.distributed.init_process_group() before wrapping the model"
            )
        check_initialized(module)
        process_group = reduce_group(process_group, device_mesh)
        self.device_mesh = device_mesh
        self.module = module
        self.process_group = process_group
        self.find_unused_parameters = options.find_unused_parameters
        self.static_graph = options.static_graph
        self.gradient_as_bucket_view = options.gradient_as_bucket_view

        self.parameters_to_ignore = ignored_names(module)
        # Before the first collective: a new watchdog takes the store's earlier records as
        # the past then (faults/board.py), when no rank can have failed in this run yet.
        self._start_watchdog()
        verify_same_model(
            model_signature(module, self.parameters_to_ignore),
            process_group,
            module_device(module, process_group),
        )
        # The ranks agree on requires_grad now (it is part of the signature): refused on
        # every rank alike, before anything is broadcast.
        if not any(p.requires_grad for _, p in self._named_parameters()):
            raise ValueError(NO_TRAINABLE)
        # Policies are resolved before any broadcast, so a bad rule fails on every rank alike.
        self.buffers_sync = BufferSync(
            module,
            process_group=process_group,
            rules=options.buffer_sync,
            default=options.buffer_policy_default,
            ignored=self.parameters_to_ignore,
            # torch DDP's forward_sync_buffers=False still starts every buffer from rank 0.
            default_is_rank_local=options.forward_sync_buffers is None,
        )
        if options.init_sync and dist.get_world_size(process_group) > 1:
            # Buffers a rule made rank-local keep each rank's value, as torch DDP does for
            # broadcast_buffers=False; everything else starts from rank 0.
            broadcast_coalesced(
                [
                    *(p for _, p in self._named_parameters()),
                    *self.buffers_sync.buffers_from_rank0(),
                ],
                process_group,
            )
        self.buffers_sync.reset_baseline()
        self.reducer = self._new_reducer()
        if options.find_unused_parameters and dist.get_world_size(process_group) > 1:
            # The ranks may run different layers in a step, so a bucket's all-reduce starts
            # at a different point of each rank's backward and could cross a SyncBatchNorm
            # layer's all-reduce on the same group: those layers move to a private one.
            separate_group(module, process_group)
        # torch DDP's rule: buffers are synced before a forward that follows a synced,
        # grad-enabled forward (and before the very first one).
        self._sync_buffers_next = True
        self._note_registrations()

    def _start_watchdog(self) -> None:
        """Have this process's watchdog (if on) watch this wrapper."""
        if self.options.watchdog:
            watch(self, self.options.stall_timeout)

    def _note_registrations(self) -> None:
        """Note the module assignments made so far."""
        # Later assignments (here, or after torch.load in a new process) may replace parameters.
        _structure.watch()
        self._registrations = _structure.registrations()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Sync buffers when due, then run the wrapped module."""
        if torch.compiler.is_compiling():
            # Under torch.compile the bookkeeping (collectives, hooks) runs eagerly at one
            # graph break and only the wrapped module is compiled. Deciding here, rather than
            # decorating the method, keeps torch._dynamo out of eager programs.
            torch.compiler.disable(self._before_forward)()
        else:
            self._before_forward()
        if self._input_device is not None:
            args, kwargs = to_device((args, kwargs), self._input_device)
        out = self.module(*args, **kwargs)
        if not torch.compiler.is_compiling():
            PROGRESS.mark(USER_CODE)
            if torch.is_grad_enabled():
                hook_outputs(out, output_hook(self.reducer.on_output_grad))
        return out

    def _before_forward(self) -> None:
        if torch.is_grad_enabled():
            PROGRESS.forward()
        else:
            PROGRESS.mark(FORWARD)
        if self._registrations != _structure.registrations():
            self._check_parameters()
        if step_unfinished(self.reducer):
            discard_step(self.reducer)
        if self._join_config.enable:
            training_step(
                self.reducer,
                self.buffers_sync,
                self.join_device,
                sync_buffers=self._sync_buffers_next and self.buffers_sync.needed,
                divide_by_initial_world_size=self._divide_by_initial_world_size,
                # Raises under throw_on_early_termination.
                notified=Join.notify_join_context(self),
            )
        elif self._sync_buffers_next and self.buffers_sync.needed:
            PROGRESS.mark(BUFFER_SYNC)
            self.buffers_sync.sync()
            PROGRESS.mark(FORWARD)
        self.reducer.before_forward()
        grad_enabled = torch.is_grad_enabled()
        # Straight into the instance dict: nn.Module.__setattr__ (which sorts parameters,
        # buffers and submodules) costs more than the rest of this bookkeeping per step.
        self.__dict__["_sync_buffers_next"] = grad_enabled and self.reducer.sync_enabled
        if grad_enabled:
            refuse_dist_autograd()
            self.reducer.expect_backward()

    forward_sync_buffers = ForwardSyncSwitch()
    """Whether buffers sync before forwards: torch DDP 2.13's attribute, settable (True or
    False). False when wrapped with ``forward_sync_buffers=False`` or
    ``default_buffer_policy="none"``; set to False, it stops every buffer sync before
    forwards, ``buffer_sync`` rules included."""
    broadcast_buffers = forward_sync_buffers
    """``forward_sync_buffers`` under its older torch DDP name."""

    def _check_parameters(self) -> None:
        """Tell the reducer if the module's Parameter objects are no longer those it hooks."""
        self._registrations = _structure.registrations()
        r = self.reducer
        self.reducer.module_changed(
            *parameter_changes(r.all_names, r.all_params, self._named_parameters())
        )

    def _new_reducer(self) -> Reducer:
        reducer = Reducer(
            self._named_parameters(),
            process_group=self.process_group,
            options=self.options,
            sparse_names=sparse_parameters(self.module),
            buffer_layout=self.buffers_sync,
        )
        # A wrapper that is dropped takes its hooks along, as torch DDP's reducer does when
        # it is destroyed: the module trains plainly again, and a new wrapper is alone on it.
        # (The hooks hold the reducer, not the wrapper, so the wrapper can be collected.)
        weakref.finalize(self, _detach, reducer, self.buffers_sync).atexit = False
        return reducer

    def __getstate__(self) -> dict[str, Any]:
        """What ``copy.deepcopy`` and pickling take: all but the reducer (torch DDP's rule).

        Only a wrapper on the default process group can be copied. The copy builds a
        reducer of its own, with the learned bucket order and without a communication hook,
        and communicates nothing while being built.
        """
        if self.process_group is not None:
            raise RuntimeError(NOT_COPYABLE)
        state = self.__dict__.copy()
        del state["reducer"]
        state["_bucket_order"] = learned_order(self.reducer)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild the reducer of a copy (``copy.deepcopy``, ``torch.load``)."""
        order = state.pop("_bucket_order", None)
        super().__setstate__(state)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(NO_GROUP_TO_LOAD)
        self.reducer = self._new_reducer()
        self.buffers_sync.world_size = self.reducer.world_size  # torch.load: maybe another
        if order is not None:
            self.reducer.load_order(order)
        self._start_watchdog()
        self._note_registrations()

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The module's parameters this wrapper synchronizes: all but the ignored ones."""
        ignored = self.parameters_to_ignore
        return [(n, p) for n, p in self.module.named_parameters() if n not in ignored]

    _set_params_and_buffers_to_ignore_for_model = staticmethod(set_ignored)  # torch DDP's

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next synced backward reduces the sum.

        As with torch DDP, a forward run inside decides: its backward does not communicate.
        """
        before = self.reducer.sync_enabled
        self.reducer.enable_sync(False)
        try:
            yield
        finally:
            self.reducer.enable_sync(before)

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce gradient buckets with ``hook(state, bucket) -> Future`` (torch DDP's API).

        The hooks of ``torch.distributed.algorithms.ddp_comm_hooks`` work as they do with
        torch DDP (``allreduce_hook``, ``fp16_compress_hook``, PowerSGD, ...). The hook gets
        the bucket's local gradients, not yet averaged; its future holds the reduced buffer.
        Once per wrapper, between steps, and on every rank at the same point (torch DDP
        already needs the same hook on every rank): with a hook that launches collectives
        from its callbacks (PowerSGD), the step's bookkeeping all-reduce gets a private
        process group with the wrapper's ranks, made here. SyncBatchNorm layers over the
        wrapper's group move to a private copy of it too (``docs/syncbn.md``). See
        ``docs/comm-hooks.md``.
        """
        self.reducer.register_comm_hook(state, hook)
        # A hook's callbacks may launch collectives on another thread: SyncBatchNorm's move.
        separate_group(self.module, self.process_group)

    @property
    def comm_hook_state(self) -> Any:
        """The registered communication hook's state (``None`` without a hook)."""
        return hook_state(self.reducer.launcher)

    @property
    def bucket_plan(self) -> BucketPlan:
        """The buckets in launch order (names, numel, nbytes, dtype per bucket)."""
        return self.reducer.plan

    @property
    def comm_stats(self) -> CommStats:
        """Collectives, bytes reduced and end-of-backward wait of the last synced step."""
        return self.reducer.stats

    @property
    def bucket_order(self) -> list[str] | None:
        """The learned gradient-ready order (for checkpoints), or None if not learned yet."""
        return learned_order(self.reducer)

    @property
    def tuned_bucket_sizes(self) -> tuple[float, float] | None:
        """The ``(bucket_cap_mb, first_bucket_mb)`` that ``"auto"`` chose, or None (yet)."""
        tuner = self.reducer.tuner
        return tuner.choice if tuner is not None else None

    def load_bucket_sizes(self, bucket_cap_mb: float, first_bucket_mb: float) -> bool:
        """Adopt sizes ``"auto"`` chose before (a checkpoint's); False unless ``"auto"``."""
        tuner = self.reducer.tuner
        if tuner is not None:
            tuner.adopt(float(bucket_cap_mb), float(first_bucket_mb))
        return tuner is not None

    def load_bucket_order(self, order: Sequence[str]) -> bool:
        """Adopt a learned order from a checkpoint; False if the parameter set differs."""
        return self.reducer.load_order(order)

    def sync_buffers(self) -> int:
        """Apply every buffer policy now; returns the collectives it took."""
        return self.buffers_sync.sync()

    def sync_buffers_to_save(self) -> int:
        """Sync the buffers before rank 0 saves them, only where that changes rank 0's
        values (a policy that combines the ranks', ``BufferSync.combines``): with only
        ``"broadcast"`` and ``"none"`` buffers, rank 0's values are already those, and no
        collective is made. Returns the collectives it took."""
        return self.buffers_sync.sync() if self.buffers_sync.combines else 0

    def remove_hooks(self) -> None:
        """Detach the reducer's and buffer sync's hooks, and leave the watchdog's watch."""
        _detach(self.reducer, self.buffers_sync)
        release(self)

    def prepare_for_backward(self, output: Any = None) -> None:
        """Make the next backward this wrapper's to reduce, as a forward through it does.

        For frameworks that run backward passes inside the wrapper's forward, such as
        Lightning's manual optimization, where the forward is the whole ``training_step``:
        call it before each such backward, with the tensor(s) the backward starts from
        (the loss). That backward syncs unless this call is made inside ``no_sync()``
        (or with ``require_backward_grad_sync`` False), whatever the forward decided.
        Plain training loops never need it.
        """
        self.reducer.expect_backward(decide=True)
        if torch.is_grad_enabled():
            # Like a forward's outputs: the backward's first hook, in its outermost pass.
            hook_outputs(output, self.reducer.on_output_grad)

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether the backward after the next forward syncs (torch DDP's attribute).

        ``no_sync()`` clears it for its duration. Setting it by hand before a forward, as some
        training scripts do instead of ``no_sync()``, works as with torch DDP.
        """
        return self.reducer.sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.reducer.enable_sync(bool(value))


def _detach(reducer: Reducer, buffers_sync: BufferSync) -> None:
    reducer.remove()
    buffers_sync.remove()
