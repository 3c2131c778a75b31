"""Bucket planning: which gradients are reduced together, and in which order.

Pure functions of their inputs: no tensors, no process groups, no hooks. The reducer
turns a plan into storage and collectives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

MB = 1024 * 1024


@dataclass(frozen=True)
class ParamInfo:
    """What the planner needs to know of one trainable parameter."""

    name: str
    numel: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """One bucket: parameters reduced by a single collective, in slot order."""

    index: int
    names: tuple[str, ...]
    numel: int
    nbytes: int
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class BucketPlan:
    """The buckets in launch order. Every rank must hold the same plan."""

    buckets: tuple[Bucket, ...]
    order: tuple[str, ...]
    """The parameter order the plan was filled from (ready order, or reverse registration)."""
    learned: bool = False
    """True when ``order`` came from an observed backward pass rather than registration."""

    def __iter__(self) -> Iterator[Bucket]:
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)

    def __getitem__(self, i: int) -> Bucket:
        return self.buckets[i]

    def describe(self) -> str:
        """A short multi-line summary, one bucket a line, for logs."""
        lines = [f"{len(self.buckets)} buckets ({'learned' if self.learned else 'initial'} order)"]
        for b in self.buckets:
            head = ", ".join(b.names[:3]) + (", ..." if len(b.names) > 3 else "")
            lines.append(
                f"  [{b.index}] {b.dtype} {b.device} {len(b.names)} params "
                f"{b.nbytes / MB:.2f} MB: {head}"
            )
        return "\n".join(lines)


def cap_bytes(megabytes: float) -> int:
    """A bucket size in bytes, at least one: a tiny size means one parameter per bucket."""
    return max(1, int(megabytes * MB))


def plan_buckets(
    params: Sequence[ParamInfo],
    *,
    cap_bytes: int,
    first_cap_bytes: int,
    order: Sequence[str] | None = None,
) -> BucketPlan:
    """Group parameters into buckets.

    Args:
        params: trainable parameters in registration order.
        cap_bytes: a bucket closes once it holds at least this many bytes.
        first_cap_bytes: the cap of the first bucket of each (dtype, device) group, kept small
            so the first collective starts early in backward.
        order: the order in which gradients became ready, by name. Names it lacks (say,
            parameters unused in the observed step) follow in reverse registration order.
            ``None`` means reverse registration order, a good guess for sequential models.

    Returns:
        A plan whose buckets are sorted by when their last gradient is expected, so that
        launching them in plan order never waits on a later bucket.

    Raises:
        ValueError: on a bad cap, duplicate names, or an order naming unknown parameters.
    """
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(
            f"bucket caps must be positive, got bucket_cap_mb={cap_bytes / MB} "
            f"and first_bucket_mb={first_cap_bytes / MB}"
        )
    by_name: dict[str, ParamInfo] = {}
    for p in params:
        if p.name in by_name:
            raise ValueError(f"parameter name {p.name!r} appears twice")
        by_name[p.name] = p

    reverse = [p.name for p in reversed(params)]
    if order is None:
        full_order = reverse
    else:
        unknown = [n for n in order if n not in by_name]
        if unknown:
            raise ValueError(f"bucket order names unknown parameters {unknown[:5]}")
        listed = dict.fromkeys(order)
        full_order = list(listed) + [n for n in reverse if n not in listed]

    # One open bucket per (dtype, device); a bucket closes when it reaches its cap.
    open_: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    started: dict[tuple[torch.dtype, torch.device], int] = {}
    groups: list[tuple[int, list[str]]] = []  # (position of last member, names)
    for pos, name in enumerate(full_order):
        p = by_name[name]
        key = (p.dtype, p.device)
        members = open_.setdefault(key, [])
        members.append(name)
        open_bytes[key] = open_bytes.get(key, 0) + p.nbytes
        limit = first_cap_bytes if started.get(key, 0) == 0 else cap_bytes
        if open_bytes[key] >= limit:
            groups.append((pos, members))
            started[key] = started.get(key, 0) + 1
            del open_[key]
            open_bytes[key] = 0
    for members in open_.values():
        groups.append((full_order.index(members[-1]), members))
    groups.sort(key=lambda g: g[0])

    buckets = []
    for i, (_, names) in enumerate(groups):
        first = by_name[names[0]]
        numel = sum(by_name[n].numel for n in names)
        buckets.append(
            Bucket(
                index=i,
                names=tuple(names),
                numel=numel,
                nbytes=numel * first.dtype.itemsize,
                dtype=first.dtype,
                device=first.device,
            )
        )
    return BucketPlan(tuple(buckets), tuple(full_order), learned=order is not None)
