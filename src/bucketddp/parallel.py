"""BucketDataParallel: a drop-in for torch's DistributedDataParallel in a hand-written loop."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from . import _structure
from .buckets import BucketPlan, check_bucket_sizes
from .buffers import BufferSync, Policy
from .comm import IGNORED_KIND, broadcast_coalesced, module_device, verify_same_model
from .comm_hooks import CommHook
from .join import BucketJoinHook, check_joinable, exchange_header, header
from .reducer import NO_TRAINABLE, CommStats, Reducer
from .syncbn import separate_group

log = logging.getLogger(__name__)


class BucketDataParallel(nn.Module, Joinable):
    """Data-parallel training with a bucketed gradient reducer that overlaps backward.

    Wrap a module exactly as you would with ``torch.nn.parallel.DistributedDataParallel``:
    the gradients after ``backward()`` are the average over ranks, the parameters and
    buffers start from rank 0's values, and ``state_dict()`` keys carry a ``module.``
    prefix. Parameters may be frozen or unfrozen after wrapping, alike on every rank; the
    reducer follows (see ``docs/engine.md``).

    Args:
        module: the model, already on its device; the same model on every rank.
        process_group: the group to reduce over; the default group if None.
        bucket_cap_mb: a bucket is launched once it holds this many MB of gradients (None:
            25, torch DDP's default, as there).
        first_bucket_mb: the cap of the first bucket, kept small so that communication
            starts early in backward (None: 1, torch DDP's with its default cap).
        find_unused_parameters: allow parameters that get no gradient in a step (control
            flow, frozen branches). Without it such a step raises an error naming them.
        gradient_as_bucket_view: make each ``param.grad`` a view into its bucket, saving
            a copy and the memory of a second gradient buffer.
        broadcast_buffers: torch DDP's switch (True if None); False is the same as
            ``default_buffer_policy="none"``, buffers keeping each rank's value from the
            start.
        buffer_sync: a policy per buffer name or fnmatch pattern (see ``docs/buffers.md``).
        default_buffer_policy: the policy of buffers no rule names.
        device_ids: torch DDP's argument, for a module on one accelerator: ``[local_rank]``
            or ``[device]``, naming the module's own device. Tensors in the forward's
            arguments are then moved to it, as torch DDP does. None (the default) or ``[]``
            for a CPU module.
        output_device: torch DDP's argument: None, or the device of ``device_ids``.
        static_graph: torch DDP's promise that every step runs the same graph. A parameter
            may then get several gradients in one backward (a layer shared by reentrant
            checkpoint segments), and parameters the graph never uses are allowed without
            ``find_unused_parameters``. The first synced backward counts the gradients and
            reduces at its end, without overlap.
        init_sync: broadcast parameters and buffers from rank 0 at wrapping (torch DDP's
            argument). False keeps each rank's values; the models are still checked to
            match.
        forward_sync_buffers: torch DDP 2.13's successor of ``broadcast_buffers``: False
            stops syncing buffers before each forward, but they still start from rank 0.
        device_mesh: a one-dimensional ``DeviceMesh`` to reduce over, instead of
            ``process_group``.

    Raises:
        RuntimeError: when no process group is initialized, the ranks' models differ, or
            the module has lazy or meta parameters.
        TypeError: ``module`` is not an ``nn.Module``, ``process_group`` not a group, a
            bucket size not a number, or ``_ddp_params_and_buffers_to_ignore`` a string.
        ValueError: ``module`` is or holds a data-parallel wrapper, or has no parameter
            that requires a gradient; on bad bucket sizes or
            buffer policies, buffer options that contradict each other, ``device_ids`` and
            ``output_device`` that do not name the module's one accelerator, or a
            ``device_mesh`` given with a ``process_group`` or with more than one dimension.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = 25.0,
        first_bucket_mb: float | None = 1.0,
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
        device_mesh: Any = None,
    ) -> None:
        check_wrappable(module)
        check_switches(
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=broadcast_buffers,
            static_graph=static_graph,
            init_sync=init_sync,
            forward_sync_buffers=forward_sync_buffers,
        )
        super().__init__()
        Joinable.__init__(self)
        self._divide_by_initial_world_size = True
        self._input_device = input_device(
            {p.device for p in module.parameters()}, device_ids, output_device
        )
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "BucketDataParallel needs a process group: call "
                "torch.distributed.init_process_group() before wrapping the model"
            )
        bucket_cap_mb, first_bucket_mb = check_bucket_sizes(bucket_cap_mb, first_bucket_mb)
        check_initialized(module)
        default_buffer_policy = buffer_default(
            broadcast_buffers, forward_sync_buffers, default_buffer_policy
        )
        if device_mesh is not None:
            process_group = mesh_group(device_mesh, process_group)
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "process_group must be a torch.distributed.ProcessGroup (from "
                f"dist.new_group(), say) or None for the default group, got "
                f"{type(process_group).__name__} {process_group!r}"
            )
        self.device_mesh = device_mesh
        self.module = module
        self.process_group = process_group
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view

        self.parameters_to_ignore = ignored_names(module)
        verify_same_model(
            _signature(module, self.parameters_to_ignore),
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
            rules=buffer_sync,
            default=default_buffer_policy,
            ignored=self.parameters_to_ignore,
            # torch DDP's forward_sync_buffers=False still starts every buffer from rank 0.
            default_is_rank_local=forward_sync_buffers is None,
        )
        if init_sync and dist.get_world_size(process_group) > 1:
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
        # Kept for a copy of the wrapper (``__setstate__``), which builds a reducer of its own.
        self._reducer_options: dict[str, Any] = {
            "bucket_cap_mb": bucket_cap_mb,
            "first_bucket_mb": first_bucket_mb,
            "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
        }
        self.reducer = self._new_reducer()
        if find_unused_parameters and dist.get_world_size(process_group) > 1:
            # The ranks may run different layers in a step, so a bucket's all-reduce starts
            # at a different point of each rank's backward and could cross a SyncBatchNorm
            # layer's all-reduce on the same group: those layers move to a private one.
            separate_group(module, process_group)
        # torch DDP's rule: buffers are synced before a forward that follows a synced,
        # grad-enabled forward (and before the very first one).
        self._sync_buffers_next = True
        # Parameter and submodule assignments in the process, when the parameters were
        # last compared with the reducer's: a change means they may have been replaced.
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
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            _hook_outputs(out, self.reducer.on_output_grad)
        return out

    def _before_forward(self) -> None:
        if self._registrations != _structure.registrations():
            self._check_parameters()
        if self.reducer.step_unfinished:
            self.reducer.discard_step()
        if self._join_config.enable:
            self._join_step()
        elif self._sync_buffers_next and self.buffers_sync.needed:
            self.buffers_sync.sync()
        self.reducer.watch_requires_grad()
        grad_enabled = torch.is_grad_enabled()
        self._sync_buffers_next = grad_enabled and self.reducer.sync_enabled
        if grad_enabled:
            self.reducer.arm()

    def _join_step(self) -> None:
        """Inside ``join()``: tell the joined ranks what this iteration does, then sync buffers."""
        notified = Join.notify_join_context(self)  # raises under throw_on_early_termination
        world_size = self.reducer.world_size
        part = header(
            self.reducer.rank,
            world_size,
            sync_buffers=self._sync_buffers_next and self.buffers_sync.needed,
            sync_backward=torch.is_grad_enabled() and self.reducer.sync_enabled,
        )
        step = exchange_header(part, self.process_group, self.join_device, world_size)
        if notified is not None:
            notified.wait()
        if step.sync_buffers:
            self.buffers_sync.sync(src=step.src, ranks=step.ranks)
        if step.sync_backward:
            by_initial = self._divide_by_initial_world_size
            self.reducer.set_divisor(world_size if by_initial else step.ranks)
            self.reducer.set_training_ranks(step.ranks)

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """A context manager for uneven inputs: ranks may run out of batches at different steps.

        Torch DDP's ``join()``: ``with model.join(): for batch in loader: ...``. A rank that
        runs out of batches matches the collectives of the ranks still training, contributing
        zero gradients, until every rank is done; then every rank takes the parameters (and
        broadcast buffers) of a rank that joined last. Every grad-enabled forward inside it
        must be followed by one backward. See "Uneven inputs" in ``docs/engine.md``.

        Args:
            divide_by_initial_world_size: average gradients over the world size (True, the
                default: every sample weighs the same) or over the ranks still training.
            enable: False makes the context manager do nothing (inputs known to be even).
            throw_on_early_termination: raise a RuntimeError on every rank as soon as one
                rank runs out of batches, instead of training on.

        Raises:
            ValueError: the module has SyncBatchNorm layers, whose forward communicates.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook torch's ``Join`` runs on a rank that has joined (``Joinable`` interface).

        Takes ``divide_by_initial_world_size`` (default True) from ``Join``'s keyword
        arguments.
        """
        check_joinable(self.module)
        self._divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))
        return BucketJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the join context's own collectives: the module's (``Joinable``)."""
        return next(iter(self.reducer.all_params)).device

    @property
    def join_process_group(self) -> Any:
        """The process group of the join context's collectives (``Joinable``)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _end_join(self) -> None:
        """Leave join mode: called by the join hook once every rank has joined."""
        self._join_config = self._join_config._replace(enable=False)
        self.reducer.set_divisor(self.reducer.world_size)
        self.reducer.set_training_ranks(self.reducer.world_size)
        self._sync_buffers_next = True

    def _check_parameters(self) -> None:
        """Tell the reducer if the module's Parameter objects are no longer those it hooks."""
        self._registrations = _structure.registrations()
        current = self._named_parameters()
        known = {id(p) for p in self.reducer.all_params}
        now = {id(p) for _, p in current}
        added = [(n, p) for n, p in current if id(p) not in known]
        removed = [
            n
            for n, p in zip(self.reducer.all_names, self.reducer.all_params, strict=True)
            if id(p) not in now
        ]
        self.reducer.module_changed(added, removed)

    def _new_reducer(self) -> Reducer:
        reducer = Reducer(
            self._named_parameters(),
            process_group=self.process_group,
            sparse_names=_sparse_parameters(self.module),
            **self._reducer_options,
        )
        reducer.buffer_layout = self.buffers_sync
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
            raise RuntimeError(
                "a BucketDataParallel on its own process group (or device_mesh) cannot be "
                "copied or pickled, as with torch DDP: only the default group can be found "
                "again in the copy. Copy model.module instead and wrap the copy."
            )
        state = self.__dict__.copy()
        del state["reducer"]
        state["_bucket_order"] = self.reducer.learned_order
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild the reducer of a copy (``copy.deepcopy``, ``torch.load``)."""
        order = state.pop("_bucket_order", None)
        super().__setstate__(state)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "loading a pickled BucketDataParallel needs the default process group: call "
                "torch.distributed.init_process_group() first, or save model.module instead"
            )
        self.reducer = self._new_reducer()
        self.buffers_sync.world_size = self.reducer.world_size  # torch.load: maybe another
        if order is not None:
            self.reducer.load_order(order)
        # torch.load in a new process: the module-change check needs its counter there too.
        _structure.watch()
        self._registrations = _structure.registrations()

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The module's parameters this wrapper synchronizes: all but the ignored ones."""
        ignored = self.parameters_to_ignore
        return [(n, p) for n, p in self.module.named_parameters() if n not in ignored]

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
        module: nn.Module, params_and_buffers_to_ignore: Collection[str]
    ) -> None:
        """Make a wrapper built later leave these parameters and buffers alone (torch DDP's API).

        Sets ``module._ddp_params_and_buffers_to_ignore``, the attribute both this wrapper
        and torch DDP read. Names are those of ``named_parameters()`` and
        ``named_buffers()``; see "Ignored parameters and buffers" in ``docs/engine.md``.
        """
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore  # type: ignore[assignment]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next synced backward reduces the sum.

        As with torch DDP, a forward run inside decides: its backward does not communicate.
        """
        before = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield
        finally:
            self.reducer.sync_enabled = before

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce gradient buckets with ``hook(state, bucket) -> Future`` (torch DDP's API).

        The hooks of ``torch.distributed.algorithms.ddp_comm_hooks`` work as they do with
        torch DDP (``allreduce_hook``, ``fp16_compress_hook``, PowerSGD, ...). The hook gets
        the bucket's local gradients, not yet averaged; its future holds the reduced buffer.
        Once per wrapper, between steps. SyncBatchNorm layers that normalize over the
        wrapper's group are moved to a private copy of it (see ``docs/syncbn.md``). See
        ``docs/engine.md``.
        """
        self.reducer.register_comm_hook(state, hook)
        # A hook may launch collectives from another thread (its futures' callbacks), which
        # would race SyncBatchNorm's all-reduces on the same group: those move to their own.
        separate_group(self.module, self.process_group)

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
        return self.reducer.learned_order

    def load_bucket_order(self, order: Sequence[str]) -> bool:
        """Adopt a learned order from a checkpoint; False if the parameter set differs."""
        return self.reducer.load_order(order)

    def sync_buffers(self) -> int:
        """Apply every buffer policy now; returns the collectives it took."""
        return self.buffers_sync.sync()

    def remove_hooks(self) -> None:
        """Detach the reducer's and the buffer sync's hooks, leaving ``.module`` plain."""
        _detach(self.reducer, self.buffers_sync)

    def prepare_for_backward(self, output: Any = None) -> None:
        """Make the next backward this wrapper's to reduce, as a forward through it does.

        For frameworks that run backward passes inside the wrapper's forward, such as
        Lightning's manual optimization, where the forward is the whole ``training_step``:
        call it before each such backward, with the tensor(s) the backward starts from
        (the loss). That backward syncs unless this call is made inside ``no_sync()``
        (or with ``require_backward_grad_sync`` False), whatever the forward decided.
        Plain training loops never need it.
        """
        self.reducer.arm(decide=True)
        if torch.is_grad_enabled():
            # Like a forward's outputs: the backward's first hook, in its outermost pass.
            _hook_outputs(output, self.reducer.on_output_grad)

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether the backward after the next forward syncs (torch DDP's attribute).

        ``no_sync()`` clears it for its duration. Setting it by hand before a forward, as some
        training scripts do instead of ``no_sync()``, works as with torch DDP.
        """
        return self.reducer.sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.reducer.sync_enabled = bool(value)


def _detach(reducer: Reducer, buffers_sync: BufferSync) -> None:
    reducer.remove()
    buffers_sync.remove()


def check_wrappable(module: object) -> None:
    """Raise unless ``module`` is an ``nn.Module`` with no data-parallel wrapper inside it.

    A wrapper inside (the module itself, or a submodule) would reduce its parameters'
    gradients a second time. torch DDP does not check this.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: naming the wrapper found and what to wrap instead.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"BucketDataParallel wraps an nn.Module, got {type(module).__name__}")
    wrappers = (BucketDataParallel, nn.parallel.DistributedDataParallel)
    for name, sub in module.named_modules():
        if isinstance(sub, wrappers):
            where = f"its submodule {name!r} is" if name else "it is already"
            raise ValueError(
                f"cannot wrap this module: {where} a {type(sub).__name__}, whose hooks "
                "already reduce those gradients, so they would be reduced twice. Wrap the "
                "plain model once: pass wrapper.module instead of the wrapper."
            )


def check_switches(**switches: object) -> None:
    """Raise if an on/off option holds something other than True or False (or None).

    None is allowed for the options whose default it is (``broadcast_buffers``,
    ``forward_sync_buffers``); 0 and 1 pass as well. Anything else, a string from a
    command line above all (``"False"`` is true in Python), would silently switch the
    option on, so it is refused.

    Raises:
        TypeError: naming the first such option and its value.
    """
    for name, value in switches.items():
        if value is None and name in _OPTIONAL_SWITCHES:
            continue
        if isinstance(value, numbers.Integral) and value in (0, 1):  # bools included
            continue
        allowed = "True, False or None" if name in _OPTIONAL_SWITCHES else "True or False"
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}")


_OPTIONAL_SWITCHES = frozenset({"broadcast_buffers", "forward_sync_buffers"})


def check_initialized(module: nn.Module) -> None:
    """Raise if ``module`` has parameters or buffers without data yet.

    Lazy ones (``nn.LazyLinear`` and kin) have no shape before the first forward; meta ones
    (built under ``torch.device("meta")``) have no storage. Neither can be compared across
    ranks, broadcast or bucketed.

    Raises:
        RuntimeError: naming them and what to do.
    """
    tensors = [*module.named_parameters(), *module.named_buffers()]
    lazy = [n for n, t in tensors if nn.parameter.is_lazy(t)]
    if lazy:
        raise RuntimeError(
            f"the module's parameters or buffers {lazy[:10]} are not initialized yet (a lazy "
            "module such as nn.LazyLinear): run one forward pass on a batch first, so that "
            "they get their shapes, then wrap the module"
        )
    meta = [n for n, t in tensors if t.is_meta]
    if meta:
        raise RuntimeError(
            f"the module's parameters or buffers {meta[:10]} are on the meta device and hold "
            "no data: materialize them first (module.to_empty(device=...), then initialize "
            "or load the weights), then wrap the module"
        )


def buffer_default(
    broadcast_buffers: bool | None,
    forward_sync_buffers: bool | None,
    default_buffer_policy: Policy | None,
) -> Policy:
    """The policy of buffers no rule names, from the wrapper's three buffer options.

    ``broadcast_buffers`` and ``forward_sync_buffers`` are torch DDP's switches (the second
    replaces the first in torch 2.13); False means ``"none"``, None means not given.

    Raises:
        ValueError: the options contradict each other, naming them.
    """
    given = {
        name: value
        for name, value in (
            ("broadcast_buffers", broadcast_buffers),
            ("forward_sync_buffers", forward_sync_buffers),
        )
        if value is not None
    }
    if len(set(given.values())) > 1:
        raise ValueError(
            f"broadcast_buffers={broadcast_buffers} contradicts forward_sync_buffers="
            f"{forward_sync_buffers}; pass only forward_sync_buffers (torch 2.13's name)"
        )
    if default_buffer_policy is None:
        return "none" if False in given.values() else "broadcast"
    for switch in given.values():
        # False means no sync, True a sync: "none", or any other policy, contradicts it.
        if switch is (default_buffer_policy == "none"):
            name = next(iter(given))
            raise ValueError(
                f"{name}={switch} contradicts default_buffer_policy={default_buffer_policy!r}; "
                "pass only one of them"
            )
    return default_buffer_policy


def mesh_group(device_mesh: Any, process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The process group of a one-dimensional ``DeviceMesh`` (torch DDP's ``device_mesh``).

    Raises:
        ValueError: a ``process_group`` was given too, or the mesh has several dimensions.
    """
    if process_group is not None:
        raise ValueError(
            "pass either process_group or device_mesh, not both: the mesh already names "
            "the group to reduce over"
        )
    if device_mesh.ndim != 1:
        names = getattr(device_mesh, "mesh_dim_names", None)
        raise ValueError(
            f"device_mesh has {device_mesh.ndim} dimensions {names or ''}; pass the "
            "one-dimensional data-parallel part of it, e.g. device_mesh['dp']"
        )
    group: dist.ProcessGroup = device_mesh.get_group(0)
    return group


def input_device(
    devices: set[torch.device],
    device_ids: Sequence[int | str | torch.device] | None,
    output_device: int | str | torch.device | None,
) -> torch.device | None:
    """The device that ``device_ids`` names for a module on ``devices``, or None.

    torch DDP's rules: only a module on a single accelerator takes ``device_ids``, one
    device per process; ``output_device`` may only repeat it. An integer is an index on the
    module's device type.

    Raises:
        ValueError: naming the arguments, the module's devices and what to pass instead.
    """
    if not device_ids and output_device is None:
        return None
    shown = ", ".join(sorted(str(d) for d in devices)) or "no parameters"
    both = f"device_ids={list(device_ids or [])} and output_device={output_device!r}"
    if len(devices) != 1:
        raise ValueError(
            f"{both} apply to a module on one accelerator, but the module's parameters are on "
            f"{shown}; pass neither for a module that spans devices"
        )
    if next(iter(devices)).type == "cpu":
        raise ValueError(
            f"{both} apply to a module on one accelerator, but the module's parameters are on "
            "cpu; pass neither (the default) for a CPU module, or move the module to its "
            "accelerator first"
        )
    (device,) = devices
    if not device_ids or len(device_ids) != 1:
        raise ValueError(
            f"device_ids={list(device_ids or [])}: give exactly one device per process, the "
            f"module's own ({device}), e.g. device_ids=[local_rank]"
        )
    for arg, given in (("device_ids[0]", device_ids[0]), ("output_device", output_device)):
        if given is None:
            continue
        named = torch.device(device.type, given) if isinstance(given, int) else torch.device(given)
        # A device without an index ("cuda") names the module's own, as in torch DDP.
        if named.type != device.type or named.index not in (None, device.index):
            raise ValueError(
                f"{arg} names {named}, but the module's parameters are on {device}; move the "
                f"module with .to({str(named)!r}) before wrapping it, or pass "
                f"device_ids=[{device.index}]"
            )
    return device


def _hook_outputs(obj: Any, hook: Callable[[torch.Tensor], None]) -> None:
    """Register ``hook`` on every tensor in ``obj`` that this forward computed with autograd.

    Walks tuples, lists, dict values and dataclass fields, as torch DDP does to find a
    forward's outputs. Costs about 3 µs per output tensor per forward. Leaves (a parameter
    returned as it is) are skipped: a hook on one would outlive the step and pile up, one
    more per forward.
    """
    if isinstance(obj, torch.Tensor):
        if obj.grad_fn is not None:
            obj.register_hook(hook)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _hook_outputs(x, hook)
    elif isinstance(obj, dict):
        for x in obj.values():
            _hook_outputs(x, hook)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _hook_outputs(getattr(obj, f.name), hook)


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor moved to ``device``, through tuples, lists and dicts.

    Containers keep their class (namedtuples included); anything else is returned as is.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        moved = [to_device(x, device) for x in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    if isinstance(obj, list):
        return [to_device(x, device) for x in obj]
    if isinstance(obj, dict):
        out = obj.copy()  # OrderedDict and defaultdict keep their class
        for k, v in obj.items():
            out[k] = to_device(v, device)
        return out
    return obj


def ignored_names(module: nn.Module) -> frozenset[str]:
    """The names in ``module._ddp_params_and_buffers_to_ignore``, torch DDP's ignore list.

    Warns about names that are neither a parameter nor a buffer of the module: they ignore
    nothing, so what the user meant to keep rank-local would be synchronized.

    Raises:
        TypeError: the attribute is a single string rather than a collection of names.
    """
    names = getattr(module, "_ddp_params_and_buffers_to_ignore", None)
    if names is None:
        return frozenset()
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(
            f"_ddp_params_and_buffers_to_ignore is {names!r}; set it to a list of "
            "parameter and buffer names, e.g. ['head.weight', 'bn.running_mean']"
        )
    ignored = frozenset(names)
    known = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    unknown = sorted(ignored - known)
    if unknown:
        warnings.warn(
            f"_ddp_params_and_buffers_to_ignore lists {unknown[:10]}, which name no parameter "
            "or buffer of the module, so they ignore nothing; use the names of "
            "named_parameters() and named_buffers(), e.g. 'layer.0.weight'",
            stacklevel=3,
        )
    return ignored


def _signature(
    module: nn.Module, ignored: frozenset[str]
) -> list[tuple[str, str, tuple[int, ...], str]]:
    """What must agree across ranks: the synced parameters and buffers, and the ignore list.

    Ignored parameters and buffers may differ between ranks (torch DDP skips them too), but
    every rank must ignore the same names, or the ranks would plan different buckets.
    """
    sig = [
        ("parameter" if p.requires_grad else "frozen parameter", n, tuple(p.shape), str(p.dtype))
        for n, p in module.named_parameters()
        if n not in ignored
    ]
    sig += [
        ("buffer", n, tuple(b.shape), str(b.dtype))
        for n, b in module.named_buffers()
        if n not in ignored
    ]
    sig += [(IGNORED_KIND, n, (), "") for n in sorted(ignored)]
    return sig


def _sparse_parameters(module: nn.Module) -> list[str]:
    """Names of the parameters whose gradients are sparse: embeddings with ``sparse=True``."""
    ids = {
        id(m.weight)
        for m in module.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    }
    return [n for n, p in module.named_parameters() if id(p) in ids]
