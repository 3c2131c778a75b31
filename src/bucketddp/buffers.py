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

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Union

import torch
import torch.distributed as dist
from torch import nn

from .comm import all_reduce_coalesced, broadcast_coalesced

BufferFn = Callable[[torch.Tensor, "dist.ProcessGroup | None"], "torch.Tensor | None"]
Policy = Union[str, BufferFn]  # noqa: UP007  (a runtime alias; `|` with a string fails)

POLICIES = ("broadcast", "mean", "sum", "max", "min", "none")
_OPS = {"mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass(frozen=True)
class BufferGroup:
    """Buffers that share a policy, dtype and device: synced by one collective."""

    policy: Policy
    dtype: torch.dtype
    device: torch.device
    names: tuple[str, ...]


def _check_policy(policy: object, where: str) -> None:
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
        f"buffer policy for {where} is a {type(policy).__name__}, which is neither a policy "
        f"name ({', '.join(POLICIES)}) nor callable; pass a function fn(buffer, group)"
    )


def resolve_policies(
    buffers: Mapping[str, torch.dtype],
    *,
    rules: Mapping[str, Policy] | None = None,
    module_rules: Mapping[str, Policy] | None = None,
    module_defaults: Mapping[str, Policy] | None = None,
    default: Policy = "broadcast",
) -> dict[str, Policy]:
    """Give every buffer its policy, following the precedence in this module's docstring.

    Args:
        buffers: buffer name to dtype, for every buffer that is to be synced.
        rules: the wrapper's or strategy's ``buffer_sync``.
        module_rules: the module's ``configure_buffer_sync()``.
        module_defaults: per-buffer defaults a module declares for its own buffers.
        default: the policy of every buffer no rule names.

    Raises:
        ValueError: an unknown policy name, a key that matches no buffer, or ``"mean"``
            on a buffer that is not floating point.
        TypeError: a policy that is neither a name nor callable.
    """
    _check_policy(default, "default_buffer_policy")
    layers = [("buffer_sync", dict(rules or {})), ("configure_buffer_sync", dict(module_rules or {}))]
    for source, mapping in layers:
        for key, policy in mapping.items():
            _check_policy(policy, f"{key!r} in {source}")
            if key not in buffers and not fnmatch.filter(buffers, key):
                raise ValueError(
                    f"{source} key {key!r} matches no buffer; the module's buffers are "
                    f"{sorted(buffers)[:20]}"
                )

    resolved: dict[str, Policy] = {}
    for name in buffers:
        policy = _lookup(name, layers)
        if policy is None:
            policy = (module_defaults or {}).get(name, default)
        resolved[name] = policy

    for name, policy in resolved.items():
        if policy == "mean" and not buffers[name].is_floating_point:
            raise ValueError(
                f"buffer {name!r} has dtype {buffers[name]}, which cannot hold a mean; "
                "use 'sum', 'max', 'min', 'broadcast' or a custom function for it"
            )
        if policy == "sum" and buffers[name] == torch.bool:
            raise ValueError(f"buffer {name!r} is bool and cannot be summed; use 'max' or 'min'")
    return resolved


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
    resolved: Mapping[str, Policy], dtypes: Mapping[str, tuple[torch.dtype, torch.device]]
) -> list[BufferGroup]:
    """Group buffers by (policy, dtype, device); custom policies stay one group per buffer."""
    groups: dict[tuple[object, torch.dtype, torch.device], list[str]] = {}
    singles: list[BufferGroup] = []
    for name, policy in resolved.items():
        dtype, device = dtypes[name]
        if policy == "none":
            continue
        if callable(policy):
            singles.append(BufferGroup(policy, dtype, device, (name,)))
        else:
            groups.setdefault((policy, dtype, device), []).append(name)
    out = [BufferGroup(p, d, dev, tuple(n)) for (p, d, dev), n in groups.items()]  # type: ignore[arg-type]
    return out + singles


class BufferSync:
    """Applies resolved buffer policies to a module's buffers, one collective per group."""

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        rules: Mapping[str, Policy] | None = None,
        default: Policy = "broadcast",
    ) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        # Buffers are looked up through their owning module at every sync, so a buffer the
        # module reassigns (``self.n = self.n + 1``) is still the one that gets synced.
        self._owners: dict[str, tuple[nn.Module, str]] = {}
        dtypes: dict[str, torch.dtype] = {}
        module_defaults: dict[str, Policy] = {}
        for mod_name, mod in module.named_modules():
            own = getattr(mod, "default_buffer_policy", None)
            for attr, buf in mod.named_buffers(recurse=False):
                if buf is None:
                    continue
                full = f"{mod_name}.{attr}" if mod_name else attr
                self._owners[full] = (mod, attr)
                dtypes[full] = buf.dtype
                if isinstance(own, str):
                    module_defaults[full] = own
        hook = getattr(module, "configure_buffer_sync", None)
        module_rules = hook() if callable(hook) else None
        self.policies = resolve_policies(
            dtypes,
            rules=rules,
            module_rules=module_rules,
            module_defaults=module_defaults,
            default=default,
        )
        places = {n: (self._get(n).dtype, self._get(n).device) for n in self._owners}
        self.groups = group_buffers(self.policies, places)
        self._baseline: dict[str, torch.Tensor] = {}
        self.reset_baseline()

    def _get(self, name: str) -> torch.Tensor:
        mod, attr = self._owners[name]
        return mod._buffers[attr]  # type: ignore[return-value]

    def reset_baseline(self) -> None:
        """Record the current values of ``"sum"`` buffers as agreed (after a load or sync)."""
        self._baseline = {
            n: self._get(n).detach().clone() for n, p in self.policies.items() if p == "sum"
        }

    @property
    def needed(self) -> bool:
        """Whether any sync would communicate."""
        return self.world_size > 1 and bool(self.groups)

    @torch.no_grad()
    def sync(self) -> int:
        """Make the buffers agree according to their policies; returns collectives used."""
        if self.world_size == 1:
            return 0
        count = 0
        for group in self.groups:
            tensors = [self._get(n) for n in group.names]
            policy = group.policy
            if callable(policy):
                out = policy(tensors[0], self.process_group)
                if out is not None:
                    tensors[0].copy_(out)
            elif policy == "broadcast":
                count += broadcast_coalesced(tensors, self.process_group)
            elif policy == "sum":
                count += self._sync_sum(group.names, tensors)
            else:
                count += all_reduce_coalesced(tensors, _OPS[policy], self.process_group)
                if policy == "mean":
                    for t in tensors:
                        t.div_(self.world_size)
        return count

    def _sync_sum(self, names: tuple[str, ...], tensors: list[torch.Tensor]) -> int:
        # Reduce only what each rank added since the last agreed value, so that repeated
        # syncs never count the same addition twice.
        for name, t in zip(names, tensors, strict=True):
            t.sub_(self._baseline[name])
        count = all_reduce_coalesced(tensors, dist.ReduceOp.SUM, self.process_group)
        for name, t in zip(names, tensors, strict=True):
            t.add_(self._baseline[name])
            self._baseline[name].copy_(t)
        return count
