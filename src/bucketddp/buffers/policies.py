"""Buffer policies: which policy each registered buffer gets, and how buffers are grouped.

Pure functions of the module and the rules: no process groups, no collectives. Resolution
happens at wrapping, and again for buffers that appear after it (see ``layout.py``).

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
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Union

import torch
import torch.distributed as dist
from torch import nn

BufferFn = Callable[[torch.Tensor, "dist.ProcessGroup | None"], "torch.Tensor | None"]
Policy = Union[str, BufferFn]  # noqa: UP007  (a runtime alias; `|` with a string fails)

POLICIES = ("broadcast", "mean", "sum", "max", "min", "none")


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


class BufferScan(NamedTuple):
    """What one walk over a module finds of its buffers (see :func:`scan_buffers`)."""

    owners: dict[str, tuple[nn.Module, str]]  # name -> (owning module, attribute)
    dtypes: dict[str, torch.dtype]
    module_defaults: dict[str, Policy]  # a module's own default_buffer_policy, by name
    placeholders: list[str]  # buffers registered as None, to be given a tensor later


def scan_buffers(module: nn.Module, ignored: Collection[str]) -> BufferScan:
    """The module's buffers to sync, and the names registered as None, in one walk."""
    found = BufferScan({}, {}, {}, [])
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


@dataclass(frozen=True)
class BufferRules:
    """Where the buffers' policies come from, combined by the precedence above.

    Attributes:
        rules: the wrapper's or strategy's ``buffer_sync``.
        module_rules: what the module's ``configure_buffer_sync()`` returned.
        default: the policy of buffers no rule names.
        ignored: buffer names never synced (``_ddp_params_and_buffers_to_ignore``).
        default_is_rank_local: whether a ``"none"`` that comes from ``default`` makes a
            buffer rank-local (True), or leaves it starting from rank 0's value (False, for
            torch DDP's ``forward_sync_buffers=False``).
    """

    rules: Mapping[str, Policy] | None
    module_rules: Mapping[str, Policy] | None
    default: Policy
    ignored: frozenset[str]
    default_is_rank_local: bool = True

    @classmethod
    def read(
        cls,
        module: nn.Module,
        *,
        rules: Mapping[str, Policy] | None,
        default: Policy,
        ignored: Collection[str],
        default_is_rank_local: bool,
    ) -> BufferRules:
        """The rules for ``module``, with what its ``configure_buffer_sync()`` returns.

        Raises:
            TypeError: ``configure_buffer_sync()`` returned no mapping.
            ValueError: a rule gives a policy to an ignored buffer.
        """
        hook = getattr(module, "configure_buffer_sync", None)
        module_rules = hook() if callable(hook) else None
        check_rules(module_rules, "configure_buffer_sync() returned")
        for source, mapping in (("buffer_sync", rules), ("configure_buffer_sync()", module_rules)):
            for key in mapping or {}:
                if key in ignored:
                    raise ValueError(
                        f"{source} gives a policy to {key!r}, but the module's "
                        "_ddp_params_and_buffers_to_ignore lists it, and an ignored buffer "
                        "is never synced; remove it from one of the two"
                    )
        return cls(
            dict(rules) if rules is not None else None,
            module_rules,
            default,
            frozenset(ignored),
            default_is_rank_local,
        )

    def resolve(self, found: BufferScan) -> dict[str, Policy]:
        """Every buffer ``found`` holds with its policy, as at wrapping.

        Raises:
            ValueError, TypeError: see :func:`resolve_policies`.
        """
        return resolve_policies(
            found.dtypes,
            rules=self.rules,
            module_rules=self.module_rules,
            module_defaults=found.module_defaults,
            default=self.default,
            placeholders=found.placeholders,
        )

    def resolve_again(self, found: BufferScan, known: Mapping[str, Policy]) -> dict[str, Policy]:
        """The policies of the buffers ``found`` holds now, after wrapping.

        A buffer in ``known`` keeps its policy; one that appeared since gets its own from the
        same rules, and a rule may then match no buffer (the one it named may be gone).

        Raises:
            ValueError, TypeError: see :func:`resolve_policies`.
        """
        policies = dict(known)
        new = [n for n in found.owners if n not in policies]
        if new:
            resolved = resolve_policies(
                found.dtypes,
                rules=self.rules,
                module_rules=self.module_rules,
                module_defaults=found.module_defaults,
                default=self.default,
                unmatched_ok=True,
            )
            policies.update({n: resolved[n] for n in new})
        return {n: policies[n] for n in found.owners}

    def rank_local(
        self, policies: Mapping[str, Policy], module_defaults: Mapping[str, Policy]
    ) -> set[str]:
        """The ``"none"`` buffers that keep each rank's value from the start.

        A module that declares "none" for its own buffers (SyncBatchNorm) means they stay in
        agreement by themselves, not that they are rank-local: they still start from rank
        0's value. Only a "none" from a rule or the global default is rank-local.
        """
        layers = [("", dict(self.rules or {})), ("", dict(self.module_rules or {}))]
        return {
            n
            for n, p in policies.items()
            if p == "none"
            and (
                _lookup(n, layers) is not None
                or (n not in module_defaults and self.default_is_rank_local)
            )
        }
