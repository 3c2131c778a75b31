"""The per-step buffer sync: one collective per (policy, dtype, device) group.

``BufferSync`` applies the policies that ``policies.py`` resolves, and asks ``layout.py``
to agree with the other ranks when buffers change after wrapping.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import _structure
from .._compat import preserve_version_counters
from ..comm import (
    FlatTensors,
    all_reduce_coalesced,
    all_reduce_packed,
    broadcast_packed,
    module_device,
)
from ..naming import first_names
from .layout import AgreedLayout, Outcome, agree_policies, error_outcome, synced_view
from .policies import BufferFn, BufferRules, Policy, group_buffers, policy_label, scan_buffers

log = logging.getLogger(__name__)

_OPS = {"mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class BufferSync:
    """Applies resolved buffer policies to a module's buffers, one collective per group.

    Construction resolves the policies on every rank and checks that every rank resolved
    the same ones (see ``layout.agree_policies``), so a bad rule raises on every rank at
    setup rather than hanging one of them later. Buffers that change after wrapping are
    agreed on again by :meth:`agree_layout`.

    Loading a state dict into a module that owns ``"sum"`` buffers takes the loaded values
    as the new agreed baseline (a load hook does it), so a resume never counts the loaded
    totals again.

    Args:
        module: the model whose buffers are synced; its ``configure_buffer_sync()`` (if it
            has one) and its submodules' ``default_buffer_policy`` attributes are read here.
        process_group: the group to sync over; the default group if None.
        rules: the wrapper's or strategy's ``buffer_sync``.
        default: the policy of buffers no rule names.
        ignored: buffer names to leave alone altogether, neither synced nor broadcast at
            setup (the module's ``_ddp_params_and_buffers_to_ignore``, as torch DDP reads it).
        default_is_rank_local: whether a ``"none"`` that comes from ``default`` makes a
            buffer rank-local (True), or leaves it starting from rank 0's value (False, for
            torch DDP's ``forward_sync_buffers=False``).

    Attributes:
        policies: buffer name to policy, for every buffer of the module.
        groups: the (policy, dtype, device) groups a sync walks through, in order.
        rank_local: the ``"none"`` buffers that a rule or the global default made
            rank-local (see :meth:`buffers_from_rank0`).

    Raises:
        ValueError, TypeError: see :func:`resolve_policies`; raised on every rank.
        RuntimeError: the ranks resolved different policies.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        rules: Mapping[str, Policy] | None = None,
        default: Policy = "broadcast",
        ignored: Collection[str] = (),
        default_is_rank_local: bool = True,
    ) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        # Kept to give buffers that appear after wrapping their policies (see agree_layout).
        self._module = module
        # Buffers are looked up through their owning module at every sync, so a buffer the
        # module reassigns (``self.n = self.n + 1``) is still the one that gets synced.
        self._owners: dict[str, tuple[nn.Module, str]] = {}
        self._baseline: dict[str, torch.Tensor] = {}
        self._packed: dict[int, FlatTensors] = {}  # group index -> its reusable flat buffer
        self._hooks: list[RemovableHandle] = []
        self.rank_local: set[str] = set()
        self.paused = False  # the wrapper's forward_sync_buffers set to False
        _structure.watch()
        _structure.track(module.modules())
        self._layout = AgreedLayout()
        error: Exception | None = None
        policies: dict[str, Policy] = {}
        try:
            self._rules = BufferRules.read(
                module,
                rules=rules,
                default=default,
                ignored=ignored,
                default_is_rank_local=default_is_rank_local,
            )
            found = scan_buffers(module, self._rules.ignored)
            self._owners = found.owners
            policies = self._rules.resolve(found)
            self.rank_local = self._rules.rank_local(policies, found.module_defaults)
        except Exception as exc:  # reported to every rank by agree_policies
            error = exc
        device = module_device(module, process_group)
        self.policies = agree_policies(policies, error, process_group, device)
        self._record_layout({n: self._get(n) for n in self.policies})
        self.reset_baseline()
        self._watch_loads()
        if dist.get_rank(process_group) == 0:
            for g in self.groups:
                log.debug(
                    "buffer sync group %s %s on %s: %s",
                    policy_label(g.policy),
                    g.dtype,
                    g.device,
                    list(g.names),
                )

    def __getstate__(self) -> dict[str, Any]:
        # A copy (copy.deepcopy, pickling) of a wrapper on the default process group: the
        # group, the load hooks on the original module and the packing buffers stay behind.
        state = self.__dict__.copy()
        for key in ("process_group", "_hooks", "_packed"):
            del state[key]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = None
        self._hooks = []
        self._packed = {}
        self._watch_loads()
        _structure.watch()
        _structure.track(self._module.modules())

    def _get(self, name: str) -> torch.Tensor:
        mod, attr = self._owners[name]
        buf = mod._buffers.get(attr)
        if buf is None:
            raise RuntimeError(_none_message(name, policy_label(self.policies[name])))
        return buf

    def _current(self, name: str) -> torch.Tensor | None:
        mod, attr = self._owners[name]
        return mod._buffers.get(attr)

    def _watch_loads(self, names: Collection[str] | None = None) -> None:
        # Loading a checkpoint overwrites "sum" buffers with agreed totals; the baseline
        # must follow, or the next sync would add the loaded totals once per rank.
        by_owner: dict[int, tuple[nn.Module, list[tuple[str, str]]]] = {}
        for name, policy in self.policies.items():
            if policy == "sum" and (names is None or name in names):
                mod, attr = self._owners[name]
                by_owner.setdefault(id(mod), (mod, []))[1].append((name, attr))
        for mod, members in by_owner.values():
            watcher = _LoadWatcher(self, members)
            self._hooks.append(_register_load_pre_hook(mod, watcher.before))
            self._hooks.append(mod.register_load_state_dict_post_hook(watcher.after))

    def remove(self) -> None:
        """Detach the load hooks this object put on the module."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def reset_baseline(self, names: list[str] | None = None) -> None:
        """Take the current values of ``"sum"`` buffers as agreed by every rank.

        Construction and loading a state dict do this already; call it after writing a
        ``"sum"`` buffer by other means when the value written is the same on every rank.

        Args:
            names: the buffers to reset; every ``"sum"`` buffer if None.
        """
        with torch.inference_mode(False):  # kept for later syncs, as in ``sync``
            for name in self.policies if names is None else names:
                buf = self._current(name) if name in self._owners else None
                # Not a buffer that left the sync since, or is None until the ranks agree.
                if buf is not None and self.policies.get(name) == "sum":
                    self._baseline[name] = buf.detach().clone()

    def buffers_from_rank0(self) -> list[torch.Tensor]:
        """The buffers that must start from rank 0's value when the model is wrapped.

        That is every buffer but the rank-local ones (``"none"`` from a rule or from
        ``default_buffer_policy``), so a per-rank value set before wrapping survives, as
        with torch DDP's ``broadcast_buffers=False``. A module's own ``"none"`` default
        (SyncBatchNorm's statistics) is not rank-local: those buffers are included.
        """
        return [self._get(n) for n in self.policies if n not in self.rank_local]

    @property
    def combines(self) -> bool:
        """Whether some buffer's policy combines the ranks' values (``"mean"``, ``"sum"``,
        ``"max"``, ``"min"`` or a function). Without one, rank 0 already holds every value a
        sync would give: ``"broadcast"`` takes rank 0's, and ``"none"`` is left alone."""
        return any(p not in ("broadcast", "none") for p in self.policies.values())

    @property
    def needed(self) -> bool:
        """Whether a sync before the next forward would communicate."""
        return self.world_size > 1 and bool(self.groups) and not self.paused

    def broadcast_buffers(self) -> list[torch.Tensor]:
        """The buffers whose policy is ``"broadcast"``."""
        return [self._get(n) for n, p in self.policies.items() if p == "broadcast"]

    @torch.no_grad()
    def sync(self, *, src: int = 0, ranks: int | None = None, contribute: bool = True) -> int:
        """Make the buffers agree according to their policies.

        The keyword arguments serve uneven inputs (``BucketDataParallel.join``), where only
        some ranks still train; the defaults are those of every rank training.

        Args:
            src: the group rank whose values ``"broadcast"`` buffers take.
            ranks: how many ranks contribute to ``"mean"`` (all of them if None).
            contribute: False on a rank that has joined: it adds nothing of its own to
                ``"mean"``, ``"max"`` and ``"min"`` and takes the others' result. Its
                ``"sum"`` buffers still send what they gained since the last sync, and a
                custom function is called with its buffer as on every rank.

        Returns:
            the collectives launched: one per (policy, dtype, device) group, not counting
            those a custom function launches itself.
        """
        if self.world_size == 1:
            return 0
        # Hide the writes from autograd, as torch DDP does: a forward whose backward is still
        # to come may have saved a buffer (BatchNorm saves its running statistics), and a
        # second forward before that backward (two inputs through one model, an evaluation
        # forward) syncs the buffers again. The backward then runs on the synced values.
        # Outside inference mode even when called inside it (an evaluation loop): the flat
        # buffers and "sum" baselines made here are kept for later syncs, and an inference
        # tensor could not be written to outside inference mode.
        by_group = [[self._current(n) for n in g.names] for g in self.groups]
        with (
            torch.inference_mode(False),
            preserve_version_counters(tuple(t for ts in by_group for t in ts if t is not None)),
        ):
            return self._sync_groups(by_group, src, ranks, contribute)

    def _sync_groups(
        self,
        by_group: list[list[torch.Tensor | None]],
        src: int,
        ranks: int | None,
        contribute: bool,
    ) -> int:
        count = 0
        self._layout.departed.clear()
        for i, (group, tensors) in enumerate(zip(self.groups, by_group, strict=True)):
            policy = group.policy
            if not isinstance(policy, str):
                name = group.names[0]
                if tensors[0] is None:
                    # Set to None here: the function gets a stand-in, so that collectives it
                    # launches still match the other ranks', and the ranks agree after
                    # the next synced backward (the buffer leaves the sync, or they raise).
                    policy(self._stand_ins(group.names, tensors, policy)[0], self.process_group)
                else:
                    self._apply_custom(name, policy)
                continue
            if policy == "sum":
                count += self._sync_sum(group.names, self._stand_ins(group.names, tensors, policy))
                continue
            packed = self._packing(i, tensors)
            if policy == "broadcast":
                count += broadcast_packed(packed, self.process_group, src=src)
            else:
                count += all_reduce_packed(
                    packed,
                    _OPS[policy],
                    self.process_group,
                    divide_by=(ranks or self.world_size) if policy == "mean" else 1,
                    identity=None if contribute else _identity(policy, packed.flat.dtype),
                )
        return count

    def _packing(self, i: int, tensors: Sequence[torch.Tensor | None]) -> FlatTensors:
        # Reused from sync to sync while the group's buffers are the same tensor objects; a
        # module that reassigns a buffer (or is moved with .to()) gets a fresh packing, with
        # a stand-in for a buffer whose layout changed (see _stand_ins).
        packed = self._packed.get(i)
        if packed is None or not packed.is_for(tensors):
            group = self.groups[i]
            fitted = self._stand_ins(group.names, tensors, group.policy)
            packed = self._packed[i] = FlatTensors(fitted, as_bytes=group.policy == "broadcast")
        return packed

    def _apply_custom(self, name: str, fn: BufferFn) -> None:
        buf = self._get(name)
        out = fn(buf, self.process_group)
        if out is None or out is buf:
            return
        if not isinstance(out, torch.Tensor) or out.shape != buf.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise RuntimeError(
                f"custom buffer policy {policy_label(fn)} for {name!r} returned {got}; "
                f"return None (after editing the buffer in place) or a tensor of shape "
                f"{tuple(buf.shape)}"
            )
        buf.copy_(out)

    def _sync_sum(self, names: tuple[str, ...], tensors: list[torch.Tensor]) -> int:
        # Reduce only what each rank added since the last agreed value, so that repeated
        # syncs never count the same addition twice.
        deltas = [t - self._baseline_like(n, t) for n, t in zip(names, tensors, strict=True)]
        count = all_reduce_coalesced(deltas, dist.ReduceOp.SUM, self.process_group)
        for name, t, delta in zip(names, tensors, deltas, strict=True):
            base = self._baseline[name]
            base.add_(delta)
            t.copy_(base)
        return count

    def _baseline_like(self, name: str, t: torch.Tensor) -> torch.Tensor:
        base = self._baseline[name]
        if base.device != t.device or base.dtype != t.dtype:  # the module moved
            base = self._baseline[name] = base.to(device=t.device, dtype=t.dtype)
        return base

    @property
    def layout_changed(self) -> bool:
        """Whether this rank's buffers may no longer be those the ranks agreed on.

        True when the last sync left out a buffer whose layout changed, or when a module of
        the model gained or lost a buffer, changed one's shape or dtype, or gained a
        submodule since the ranks last agreed (see ``AgreedLayout.changed``).
        """
        return self._layout.changed

    def agree_layout(self) -> str | None:
        """Agree with the other ranks on the synced buffers: take them, or return the error.

        Called on every rank at once, after a synced backward whose flags say that some
        rank's buffers changed. Each rank reads its module's buffers anew: a buffer that
        appeared after wrapping (registered in a forward, given a tensor after being None,
        in a submodule attached later) gets its policy from the same rules, one deleted or
        set to None leaves the sync, and a reassigned one is taken with its new shape and
        dtype, as torch DDP reads its module's buffers anew at every sync. If the ranks hold
        the same synced buffers, with the same shapes and dtypes, that is the new agreement
        and None is returned; otherwise the error to raise on every rank, naming the first
        buffer that differs.
        """
        self._layout.mark_seen()
        _structure.track(self._module.modules())
        mine: Outcome
        try:
            found = scan_buffers(self._module, self._rules.ignored)
            policies = self._rules.resolve_again(found, self.policies)
            mine = ("ok", synced_view(found.owners, policies))
        except Exception as exc:  # reported to every rank
            mine = error_outcome(exc)
        device = module_device(self._module, self.process_group)
        error = self._layout.compare(mine, self.process_group, device)
        if error is None:
            self._take_layout(found.owners, policies)
        return error

    def _record_layout(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take ``tensors`` (one per policy, by name) as the layout every rank holds.

        A buffer whose shape or dtype later differs cannot take part in its group's
        collective (see ``_stand_ins``). The groups and their packings follow the layout.
        """
        self._layout.record(tensors)
        self.groups = group_buffers(self.policies, self._layout.places)
        self._packed = {}

    def _take_layout(
        self, owners: dict[str, tuple[nn.Module, str]], policies: dict[str, Policy]
    ) -> None:
        """Take ``owners`` and ``policies`` (agreed by every rank) as the buffers to sync."""
        old = self.policies
        tensors: dict[str, torch.Tensor] = {}
        for name, (mod, attr) in owners.items():
            buf = mod._buffers[attr]
            assert buf is not None  # scan_buffers skips None buffers
            tensors[name] = buf
        changed = self._layout.differs(tensors)
        self._owners = owners
        self.policies = policies
        self._record_layout(tensors)
        for name in [n for n in self._baseline if n not in policies]:
            del self._baseline[name]
        sums = [n for n in changed if policies[n] == "sum"]
        # A "sum" buffer that joins the sync has no agreed value yet: all of it counts as
        # each rank's addition. One that changed shape alike on every rank takes its value
        # as agreed, as a load does.
        self.reset_baseline([n for n in sums if n in old])
        for name in [n for n in sums if n not in old]:
            self._baseline[name] = torch.zeros_like(tensors[name])
        self._watch_loads([n for n in sums if n not in old])
        if changed or len(policies) != len(old):
            log.info(
                "bucketddp: the ranks agree on changed buffers; new or resized: %s, gone: %s",
                first_names(changed),
                first_names([n for n in old if n not in policies]),
            )

    def _stand_ins(
        self, names: tuple[str, ...], tensors: Sequence[torch.Tensor | None], policy: Policy
    ) -> list[torch.Tensor]:
        """``tensors``, with a stand-in for each buffer whose layout changed since the ranks
        agreed (see ``AgreedLayout.with_stand_ins``); a ``"sum"`` one sends its baseline."""
        baseline = self._baseline if policy == "sum" else None
        return self._layout.with_stand_ins(names, tensors, baseline)


def _none_message(name: str, policy: str) -> str:
    return (
        f"buffer {name!r} was set to None or deleted after the model was wrapped, so its "
        f"policy ({policy}) has nothing to sync. Give it a tensor again before the next "
        "forward, or wrap the model again."
    )


def _identity(policy: str, dtype: torch.dtype) -> float:
    """The value a rank that adds nothing contributes to ``policy``'s reduction."""
    if policy == "mean":
        return 0
    if dtype.is_floating_point:
        return -math.inf if policy == "max" else math.inf
    if dtype == torch.bool:
        return policy == "min"
    info = torch.iinfo(dtype)
    return info.min if policy == "max" else info.max


class _LoadWatcher:
    """Resets the baseline of one module's ``"sum"`` buffers after a load into it.

    The pre-hook notes which of them the state dict holds; the post-hook resets only
    those, so a partial load keeps the unsynced additions of the buffers it left alone.
    """

    def __init__(self, sync: BufferSync | None, members: list[tuple[str, str]]) -> None:
        # A weak reference: the module must not keep a dropped wrapper alive.
        self._sync: Callable[[], BufferSync | None] = (
            weakref.ref(sync) if sync is not None else _nothing
        )
        self._members = members
        self._loaded: list[str] = []

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy of the module (copy.deepcopy, pickling) gets an inert watcher: loading into
        # the copy must not reset the original's baselines. A wrapper built on the copy, or
        # a copy of the wrapper, registers watchers of its own.
        return (_LoadWatcher, (None, []))

    def before(
        self, _module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *_: Any
    ) -> None:
        self._loaded = [name for name, attr in self._members if prefix + attr in state_dict]

    def after(self, _module: nn.Module, _incompatible_keys: Any) -> None:
        sync = self._sync()
        if sync is not None and self._loaded:
            sync.reset_baseline(self._loaded)
        self._loaded = []


def _nothing() -> None:
    return None


def _register_load_pre_hook(module: nn.Module, hook: Callable[..., None]) -> RemovableHandle:
    # The public name arrived after torch 2.4, which the package still supports.
    register = getattr(module, "register_load_state_dict_pre_hook", None)
    if register is not None:
        return register(hook)
    return module._register_load_state_dict_pre_hook(hook, with_module=True)
