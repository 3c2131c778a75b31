"""Buffer sync policies: how each registered buffer is made to agree across ranks.

Resolution (which policy each buffer gets) is pure and happens once, at setup. Syncing
packs the buffers of each (policy, dtype, device) group into one collective.

Precedence, highest first:
1. an exact buffer name in the wrapper's/strategy's ``buffer_sync``;
2. an exact buffer name in the module's ``configure_buffer_sync()``;
3. the first fnmatch pattern in ``buffer_sync`` that matches (in the mapping's order);
4. the first fnmatch pattern in ``configure_buffer_sync()`` that matches;
5. a module's own default for its buffers (``SyncBatchNorm``'s statistics are already
   global, so its buffers default to ``"none"``);
6. ``default_buffer_policy``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import math
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import _structure
from .comm import (
    FlatTensors,
    all_reduce_coalesced,
    all_reduce_packed,
    broadcast_packed,
    gather_if_different,
    module_device,
)

log = logging.getLogger(__name__)

BufferFn = Callable[[torch.Tensor, "dist.ProcessGroup | None"], "torch.Tensor | None"]
Policy = Union[str, BufferFn]  # noqa: UP007  (a runtime alias; `|` with a string fails)

POLICIES = ("broadcast", "mean", "sum", "max", "min", "none")
_OPS = {"mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass(frozen=True)
class BufferGroup:
    """Buffers that share a policy, dtype and device: synced by one collective.

    ``dtype`` is None for a ``"broadcast"`` group, which carries every dtype as bytes.
    """

    policy: Policy
    dtype: torch.dtype | None
    device: torch.device
    names: tuple[str, ...]


def check_policy(policy: object, where: str) -> None:
    """Raise unless ``policy`` is a policy name or a callable; ``where`` names its source.

    Raises:
        ValueError: an unknown policy name.
        TypeError: neither a string nor callable.
    """
    if callable(policy):
        return
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(
                f"unknown buffer policy {policy!r} for {where}; choose one of "
                f"{list(POLICIES)} or pass a callable fn(buffer, group)"
            )
        return
    raise TypeError(
        f"buffer policy for {where} has type {type(policy).__name__}: it is neither a policy "
        f"name ({', '.join(POLICIES)}) nor callable; pass a function fn(buffer, group)"
    )


def check_rules(rules: object, where: str) -> None:
    """Raise unless ``rules`` is None or a mapping; ``where`` names what gave them.

    Raises:
        TypeError: a list, a string or anything else that is no mapping.
    """
    if rules is not None and not isinstance(rules, Mapping):
        raise TypeError(
            f"{where} a {type(rules).__name__} ({rules!r}); use a dict of buffer name or "
            "fnmatch pattern to policy, such as {'bn.running_mean': 'mean'} or {'*': 'max'}"
        )


def resolve_policies(
    buffers: Mapping[str, torch.dtype],
    *,
    rules: Mapping[str, Policy] | None = None,
    module_rules: Mapping[str, Policy] | None = None,
    module_defaults: Mapping[str, Policy] | None = None,
    default: Policy = "broadcast",
    unmatched_ok: bool = False,
    placeholders: Collection[str] = (),
) -> dict[str, Policy]:
    """Give every buffer its policy, following the precedence in this module's docstring.

    Args:
        buffers: buffer name to dtype, for every buffer that is to be synced.
        rules: the wrapper's or strategy's ``buffer_sync``.
        module_rules: the module's ``configure_buffer_sync()``.
        module_defaults: per-buffer defaults a module declares for its own buffers.
        default: the policy of every buffer no rule names.
        unmatched_ok: allow keys that match no buffer (after wrapping, when a buffer a rule
            names may have been deleted).
        placeholders: names of buffers registered as None, to be given a tensor later: a
            key may match one of them instead of a buffer.

    Returns:
        buffer name to policy, in the order of ``buffers``.

    Raises:
        ValueError: an unknown policy name, a key that matches no buffer, or a reducing
            policy on a dtype it cannot apply to (``"mean"`` on an integer or bool buffer,
            ``"sum"`` on a bool one, ``"max"``/``"min"`` on a complex one).
        TypeError: a policy that is neither a name nor callable.
    """
    check_policy(default, "default_buffer_policy")
    for name, policy in (module_defaults or {}).items():
        check_policy(policy, f"{name!r} (its module's default_buffer_policy)")
    layers = [
        ("buffer_sync", dict(rules or {})),
        ("configure_buffer_sync", dict(module_rules or {})),
    ]
    for source, mapping in layers:
        for key, policy in mapping.items():
            if not isinstance(key, str):
                raise TypeError(f"{source} key {key!r} is not a string; use a buffer name")
            check_policy(policy, f"{key!r} in {source}")
            if unmatched_ok or key in buffers or key in placeholders:
                continue
            if not any(fnmatch.fnmatchcase(n, key) for n in [*buffers, *placeholders]):
                raise ValueError(f"{source} key {key!r} matches no buffer; {_describe(buffers)}")

    resolved: dict[str, Policy] = {}
    for name in buffers:
        found = _lookup(name, layers)
        resolved[name] = found if found is not None else (module_defaults or {}).get(name, default)

    for name, policy in resolved.items():
        _check_dtype(name, policy, buffers[name])
    return resolved


def _describe(buffers: Mapping[str, torch.dtype]) -> str:
    if not buffers:
        return "the module has no buffers"
    names = sorted(buffers)
    more = f" and {len(names) - 20} more" if len(names) > 20 else ""
    return f"the module's buffers are {names[:20]}{more} (names relative to the wrapped module)"


def _check_dtype(name: str, policy: Policy, dtype: torch.dtype) -> None:
    if not isinstance(policy, str):
        return
    problem = None
    if policy == "mean" and not (dtype.is_floating_point or dtype.is_complex):
        problem = "cannot hold a mean"
    elif policy == "sum" and dtype == torch.bool:
        problem = "cannot be summed"
    elif policy in ("max", "min") and dtype.is_complex:
        problem = "has no order"
    if problem is not None:
        raise ValueError(
            f"buffer {name!r} has dtype {dtype}, which {problem} (policy {policy!r}); give it "
            f"its own rule in buffer_sync, e.g. {{{name!r}: {_fitting(dtype)!r}}} or "
            "'broadcast', or a custom function"
        )


def _fitting(dtype: torch.dtype) -> str:
    """A reducing policy that works for ``dtype``, to suggest in place of one that does not.

    The only failing policies are a mean of integers or booleans, a sum of booleans and an
    order of complex numbers.
    """
    return "mean" if dtype.is_complex else "max"


def _lookup(name: str, layers: list[tuple[str, dict[str, Policy]]]) -> Policy | None:
    for _, mapping in layers:
        if name in mapping:
            return mapping[name]
    for _, mapping in layers:
        for key, policy in mapping.items():
            if fnmatch.fnmatchcase(name, key):
                return policy
    return None


def group_buffers(
    resolved: Mapping[str, Policy], places: Mapping[str, tuple[torch.dtype, torch.device]]
) -> list[BufferGroup]:
    """Group buffers by (policy, dtype, device), in first-appearance order.

    ``"broadcast"`` buffers are grouped by device alone (``dtype`` None): a broadcast copies
    bytes, so one collective carries every dtype.
    ``"none"`` buffers form no group. A custom policy gets one group per buffer, since the
    function is called on one buffer at a time.
    """
    groups: dict[tuple[str, torch.dtype | None, torch.device], list[str]] = {}
    singles: list[BufferGroup] = []
    for name, policy in resolved.items():
        dtype, device = places[name]
        if isinstance(policy, str):
            if policy != "none":
                # A broadcast moves bytes: every dtype on a device shares one collective.
                key_dtype = None if policy == "broadcast" else dtype
                groups.setdefault((policy, key_dtype, device), []).append(name)
        else:
            singles.append(BufferGroup(policy, dtype, device, (name,)))
    out = [BufferGroup(p, d, dev, tuple(n)) for (p, d, dev), n in groups.items()]
    return out + singles


def policy_label(policy: Policy) -> str:
    """A policy as text: its name, or a custom function's qualified name."""
    if isinstance(policy, str):
        return policy
    qualname = getattr(policy, "__qualname__", type(policy).__qualname__)
    return f"{getattr(policy, '__module__', '?')}.{qualname}"


class BufferSync:
    """Applies resolved buffer policies to a module's buffers, one collective per group.

    Construction resolves the policies on every rank and checks that every rank resolved
    the same ones (one ``all_gather_object``), so a bad rule raises on every rank at setup
    rather than hanging one of them later.

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
        self._default_is_rank_local = default_is_rank_local
        self.world_size = dist.get_world_size(process_group)
        # Kept to give buffers that appear after wrapping their policies (see ``settle``).
        self._module = module
        self._rules = dict(rules) if rules is not None else None  # a copy pickles
        self._default = default
        self._ignored = frozenset(ignored)
        self._module_rules: Mapping[str, Policy] | None = None
        # Buffers are looked up through their owning module at every sync, so a buffer the
        # module reassigns (``self.n = self.n + 1``) is still the one that gets synced.
        self._owners: dict[str, tuple[nn.Module, str]] = {}
        self._baseline: dict[str, torch.Tensor] = {}
        self._packed: dict[int, FlatTensors] = {}  # group index -> its reusable flat buffer
        self._hooks: list[RemovableHandle] = []
        self.rank_local: set[str] = set()
        _structure.watch()
        _structure.track(module.modules())
        self._version = _structure.buffer_version()
        error: Exception | None = None
        policies: dict[str, Policy] = {}
        try:
            policies = self._resolve(module, self._rules, default)
        except Exception as exc:  # reported to every rank by _agree
            error = exc
        self.policies = _agree(policies, error, process_group, module_device(module, process_group))
        self._deviation: dict[str, str] = {}
        self._agree_on({n: self._get(n) for n in self.policies})
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

    def _resolve(
        self, module: nn.Module, rules: Mapping[str, Policy] | None, default: Policy
    ) -> dict[str, Policy]:
        found = _scan(module, self._ignored)
        self._owners, dtypes, module_defaults = found.owners, found.dtypes, found.module_defaults
        hook = getattr(module, "configure_buffer_sync", None)
        module_rules = hook() if callable(hook) else None
        check_rules(rules, "buffer_sync is")
        check_rules(module_rules, "configure_buffer_sync() returned")
        self._module_rules = module_rules
        for source, mapping in (("buffer_sync", rules), ("configure_buffer_sync()", module_rules)):
            for key in mapping or {}:
                if key in self._ignored:
                    raise ValueError(
                        f"{source} gives a policy to {key!r}, but the module's "
                        "_ddp_params_and_buffers_to_ignore lists it, and an ignored buffer "
                        "is never synced; remove it from one of the two"
                    )
        policies = resolve_policies(
            dtypes,
            rules=rules,
            module_rules=module_rules,
            module_defaults=module_defaults,
            default=default,
            placeholders=found.placeholders,
        )
        # A module that declares "none" for its own buffers (SyncBatchNorm) means they stay
        # in agreement by themselves, not that they are rank-local: they still start from
        # rank 0's value. Only a "none" from a rule or the global default is rank-local.
        layers = [("", dict(rules or {})), ("", dict(module_rules or {}))]
        self.rank_local = {
            n
            for n, p in policies.items()
            if p == "none"
            and (
                _lookup(n, layers) is not None
                or (n not in module_defaults and self._default_is_rank_local)
            )
        }
        return policies

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
                # Not a buffer that left the sync since, or is None until the ranks settle.
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
    def needed(self) -> bool:
        """Whether any sync would communicate."""
        return self.world_size > 1 and bool(self.groups)

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
            _preserve_versions(tuple(t for ts in by_group for t in ts if t is not None)),
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
        if self._deviation:
            self._deviation = {}
        for i, (group, tensors) in enumerate(zip(self.groups, by_group, strict=True)):
            policy = group.policy
            if not isinstance(policy, str):
                name = group.names[0]
                if tensors[0] is None:
                    # Set to None here: the function gets a stand-in, so that collectives it
                    # launches still match the other ranks', and the ranks settle after
                    # the next synced backward (the buffer leaves the sync, or they raise).
                    policy(self._fit(group.names, tensors, "custom")[0], self.process_group)
                else:
                    self._apply_custom(name, policy)
                continue
            if policy == "sum":
                count += self._sync_sum(group.names, self._fit(group.names, tensors, policy))
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

    def _fit(
        self, names: tuple[str, ...], tensors: Sequence[torch.Tensor | None], policy: str
    ) -> list[torch.Tensor]:
        """``tensors``, with a stand-in of the agreed layout for each that changed layout.

        A buffer reassigned after wrapping with another shape or dtype, or set to None (on
        some ranks only, say), would make its group's collective differ in size between
        ranks, which hangs or aborts. It is left out instead: a stand-in of the agreed shape
        (zeros; for ``"sum"`` its baseline, which adds nothing) takes its place, so every
        rank still launches the same collective, and the change is reported to every rank
        in the next synced backward (``deviates``, ``settle``).
        """
        fitted: list[torch.Tensor] = []
        for name, t in zip(names, tensors, strict=True):
            shape, dtype = self._layout[name]
            if t is not None and t.shape == shape and t.dtype == dtype:
                fitted.append(t)
                continue
            self._deviation[name] = "None" if t is None else _layout_text(t.shape, t.dtype)
            if policy == "sum":
                fitted.append(self._baseline[name])
            else:
                fitted.append(torch.zeros(shape, dtype=dtype, device=self._places[name][1]))
        return fitted

    @property
    def deviates(self) -> bool:
        """Whether this rank's buffers may no longer be those the ranks agreed on.

        True when the last sync left out a buffer whose layout changed (see ``_fit``), or
        when a module of the model gained or lost a buffer, changed one's shape or dtype,
        or gained a submodule since the ranks last agreed (torch's registration hooks).
        """
        return bool(self._deviation) or _structure.buffer_version() != self._version

    def settle(self) -> str | None:
        """Agree with the other ranks on the synced buffers: adopt them, or return the error.

        Called on every rank at once, after a synced backward whose flags say that some
        rank's buffers changed. Each rank reads
        its module's buffers anew: a buffer that appeared after wrapping (registered in a
        forward, given a tensor after being None, in a submodule attached later) gets its
        policy from the same rules, one deleted or set to None leaves the sync, and a
        reassigned one is taken with its new shape and dtype, as torch DDP reads its
        module's buffers anew at every sync. One ``all_gather_object`` compares the ranks.
        If they hold the same synced buffers, with the same shapes and dtypes, that is the
        new agreement and None is returned; otherwise the error to raise on every rank,
        naming the first buffer that differs.
        """
        self._version = _structure.buffer_version()
        _structure.track(self._module.modules())
        mine: tuple[str, Any]
        try:
            found = _scan(self._module, self._ignored)
            owners = found.owners
            policies = dict(self.policies)
            new = [n for n in owners if n not in policies]
            if new:
                resolved = resolve_policies(
                    found.dtypes,
                    rules=self._rules,
                    module_rules=self._module_rules,
                    module_defaults=found.module_defaults,
                    default=self._default,
                    unmatched_ok=True,
                )
                policies.update({n: resolved[n] for n in new})
            policies = {n: policies[n] for n in owners}
            view = {n: _synced_text(owners[n], p) for n, p in policies.items() if p != "none"}
            mine = ("ok", view)
        except Exception as exc:  # reported to every rank
            mine = ("error", f"{type(exc).__name__}: {exc}")
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.process_group)
        for rank, (kind, payload) in enumerate(gathered):
            if kind == "error":
                return f"buffers changed after the model was wrapped; on rank {rank}: {payload}"
        views = [payload for _, payload in gathered]
        for name in dict.fromkeys(n for v in views for n in v):
            seen = [v.get(name) for v in views]
            if any(v != seen[0] for v in seen):
                return self._deviation_message(name, seen)
        self._adopt(owners, policies)
        return None

    def _agree_on(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Record ``tensors`` (one per policy, by name) as the layout every rank holds.

        A buffer whose shape or dtype later differs cannot take part in its group's
        collective (see ``_fit``). The groups and their packings follow the layout.
        """
        self._layout = {n: (t.shape, t.dtype) for n, t in tensors.items()}
        self._places = {n: (t.dtype, t.device) for n, t in tensors.items()}
        self.groups = group_buffers(self.policies, self._places)
        self._packed = {}
        self._deviation = {}

    def _adopt(self, owners: dict[str, tuple[nn.Module, str]], policies: dict[str, Policy]) -> None:
        """Take ``owners`` and ``policies`` (agreed by every rank) as the buffers to sync."""
        old = self.policies
        tensors: dict[str, torch.Tensor] = {}
        for name, (mod, attr) in owners.items():
            buf = mod._buffers[attr]
            assert buf is not None  # _scan skips None buffers
            tensors[name] = buf
        changed = [n for n, t in tensors.items() if self._layout.get(n) != (t.shape, t.dtype)]
        self._owners = owners
        self.policies = policies
        self._agree_on(tensors)
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
                changed[:10],
                [n for n in old if n not in policies][:10],
            )

    def _current(self, name: str) -> torch.Tensor | None:
        mod, attr = self._owners[name]
        return mod._buffers.get(attr)

    def _deviation_message(self, name: str, seen: list[str | None]) -> str:
        by_value: dict[str | None, list[int]] = {}
        for rank, value in enumerate(seen):
            by_value.setdefault(value, []).append(rank)
        where = "; ".join(
            f"{'absent or None' if v is None else v} on ranks {r}"
            for v, r in list(by_value.items())[:4]
        )
        was = f" (it was {_layout_text(*self._layout[name])})" if name in self._layout else ""
        return (
            f"buffer {name!r} changed after the model was wrapped, and not alike on every "
            f"rank: {where}{was}. A synced buffer needs the same shape and dtype on every "
            "rank, so it was left out of the buffer sync. For a buffer holding per-rank data "
            "(a cache, the last batch) or one that only some ranks have, give it the policy "
            f"'none': buffer_sync={{{name!r}: 'none'}}, or in configure_buffer_sync(); "
            "otherwise change it alike on every rank."
        )

    def broadcast_buffers(self) -> list[torch.Tensor]:
        """The buffers whose policy is ``"broadcast"``."""
        return [self._get(n) for n, p in self.policies.items() if p == "broadcast"]

    def _packing(self, i: int, tensors: Sequence[torch.Tensor | None]) -> FlatTensors:
        # Reused from sync to sync while the group's buffers are the same tensor objects; a
        # module that reassigns a buffer (or is moved with .to()) gets a fresh packing, with
        # a stand-in for a buffer whose layout changed (see _fit).
        packed = self._packed.get(i)
        if packed is None or not packed.is_for(tensors):
            group = self.groups[i]
            fitted = self._fit(group.names, tensors, str(group.policy))
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


def _none_message(name: str, policy: str) -> str:
    return (
        f"buffer {name!r} was set to None or deleted after the model was wrapped, so its "
        f"policy ({policy}) has nothing to sync. Give it a tensor again before the next "
        "forward, or wrap the model again."
    )


class _Scan(NamedTuple):
    """What one walk over a module finds of its buffers (see :func:`_scan`)."""

    owners: dict[str, tuple[nn.Module, str]]  # name -> (owning module, attribute)
    dtypes: dict[str, torch.dtype]
    module_defaults: dict[str, Policy]  # a module's own default_buffer_policy, by name
    placeholders: list[str]  # buffers registered as None, to be given a tensor later


def _scan(module: nn.Module, ignored: Collection[str]) -> _Scan:
    """The module's buffers to sync, and the names registered as None, in one walk."""
    found = _Scan({}, {}, {}, [])
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        own = getattr(mod, "default_buffer_policy", None)
        for attr, buf in mod._buffers.items():
            full = f"{mod_name}.{attr}" if mod_name else attr
            # A tensor registered under two names is synced once, under its first name
            # (the one ``named_buffers()`` and ``state_dict()`` report).
            if full in ignored or (buf is not None and id(buf) in seen):
                continue
            if buf is None:
                found.placeholders.append(full)
                continue
            seen.add(id(buf))
            found.owners[full] = (mod, attr)
            found.dtypes[full] = buf.dtype
            if own is not None:
                found.module_defaults[full] = own
    return found


def _synced_text(owner: tuple[nn.Module, str], policy: Policy) -> str:
    """What ranks must agree on for a synced buffer: its layout (a custom policy's name)."""
    if not isinstance(policy, str):
        return f"custom policy {policy_label(policy)}"
    buf = owner[0]._buffers[owner[1]]
    assert buf is not None
    return _layout_text(buf.shape, buf.dtype)


def _layout_text(shape: torch.Size, dtype: torch.dtype) -> str:
    return f"shape {list(shape)} {str(dtype).removeprefix('torch.')}"


def _preserve_versions(tensors: tuple[torch.Tensor, ...]) -> contextlib.AbstractContextManager[Any]:
    """A context that restores the tensors' autograd version counters when it exits."""
    preserve = torch.autograd.grad_mode._unsafe_preserve_version_counter
    try:
        return preserve(tensors)
    except (AttributeError, AssertionError, TypeError):  # torch < 2.5 takes one tensor
        stack = contextlib.ExitStack()
        for t in tensors:
            stack.enter_context(preserve(t))
        return stack


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


def _agree(
    policies: dict[str, Policy],
    error: Exception | None,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> dict[str, Policy]:
    """Raise on every rank if any rank failed to resolve, or resolved differently.

    The ranks compare fingerprints first (on ``device``), and their outcomes only if those
    differ (see ``gather_if_different``): every rank raises, its own error where they all
    failed alike, or the first rank's error or difference otherwise.
    """
    world = dist.get_world_size(group)
    if world == 1:
        if error is not None:
            raise error
        return policies
    mine: tuple[str, Any] = (
        ("error", (type(error).__name__, str(error)))
        if error is not None
        else ("ok", {n: policy_label(p) for n, p in policies.items()})
    )
    gathered: list[Any] | None = gather_if_different(mine, group, device)
    if error is not None:
        raise error
    if gathered is None:
        return policies
    for rank, (kind, payload) in enumerate(gathered):
        if kind == "error":
            exc_name, message = payload
            exc_type = {"ValueError": ValueError, "TypeError": TypeError}.get(
                exc_name, RuntimeError
            )
            raise exc_type(f"on rank {rank}: {message}")
    reference = gathered[0][1]
    for rank, (_, theirs) in enumerate(gathered):
        if theirs != reference:
            diff = sorted(
                n for n in reference.keys() | theirs.keys() if reference.get(n) != theirs.get(n)
            )
            raise RuntimeError(
                f"ranks resolved different buffer policies: for {diff[:5]} rank 0 has "
                f"{[reference.get(n) for n in diff[:5]]}, rank {rank} has "
                f"{[theirs.get(n) for n in diff[:5]]}; configure_buffer_sync() and "
                "buffer_sync must give the same rules on every rank"
            )
    return policies
