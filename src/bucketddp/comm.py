"""Coalesced collectives over lists of tensors, and the same-model check.

Tensors are packed into one flat tensor per (dtype, device), so a list of any length costs
one collective per group rather than one per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


def group_rank0(group: dist.ProcessGroup | None) -> int:
    """The global rank of the group's rank 0, as ``src`` arguments expect."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def _apply_flat(tensors: Sequence[torch.Tensor], collective: Callable[[torch.Tensor], None]) -> int:
    """Run ``collective`` on one flat copy per dtype group and write results back."""
    count = 0
    for group in _by_dtype(tensors):
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        collective(flat)
        offset = 0
        with torch.no_grad():
            for t in group:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n
        count += 1
    return count


_ALIGN = 16  # bytes; every dtype's itemsize divides it, so each segment views cleanly


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
) -> int:
    """Overwrite ``tensors`` in place with the group's rank-0 values; returns collectives used.

    A broadcast copies bytes, so tensors of every dtype on one device travel together in a
    single uint8 buffer: one collective per device, where a per-dtype scheme needs one per
    dtype (BatchNorm's float statistics and int64 counter, say).
    """
    src = group_rank0(group)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, members in by_device.items():
        offsets = []
        total = 0
        for t in members:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        for t, o in zip(members, offsets, strict=True):
            flat[o : o + t.numel() * t.element_size()].copy_(_as_bytes(t))
        dist.broadcast(flat, src=src, group=group)
        with torch.no_grad():
            for t, o in zip(members, offsets, strict=True):
                raw = flat[o : o + t.numel() * t.element_size()]
                t.copy_(raw.view(t.dtype).view(t.shape))
    return len(by_device)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup | None = None,
) -> int:
    """All-reduce ``tensors`` in place with ``op``; returns collectives used."""
    return _apply_flat(tensors, lambda flat: dist.all_reduce(flat, op=op, group=group))


def verify_same_model(
    signature: list[tuple[str, str, tuple[int, ...], str]],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Raise on every rank if any rank's (kind, name, shape, dtype) list differs from rank 0's.

    Every rank takes part in the same single all-gather, so a mismatch is reported
    everywhere and no rank is left waiting in a later collective.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, signature, group=group)
    reference = gathered[0]
    assert isinstance(reference, list)
    for rank, theirs in enumerate(gathered[1:], start=1):
        assert isinstance(theirs, list)
        problem = _first_difference(reference, theirs)
        if problem is not None:
            raise RuntimeError(
                f"BucketDataParallel: the model on rank {rank} differs from rank 0: {problem}. "
                "Build the same model on every rank before wrapping it."
            )


def _first_difference(ref: list, other: list) -> str | None:
    for (kind, name, shape, dtype), theirs in zip(ref, other, strict=False):
        t_kind, t_name, t_shape, t_dtype = theirs
        if (kind, name) != (t_kind, t_name):
            return f"rank 0 has {kind} {name!r} where it has {t_kind} {t_name!r}"
        if shape != t_shape:
            return f"{kind} {name!r} has shape {list(shape)} on rank 0 but {list(t_shape)}"
        if dtype != t_dtype:
            return f"{kind} {name!r} has dtype {dtype} on rank 0 but {t_dtype}"
    if len(ref) != len(other):
        longer, who = (ref, "rank 0") if len(ref) > len(other) else (other, "it")
        kind, name, _, _ = longer[min(len(ref), len(other))]
        return f"only {who} has {kind} {name!r}"
    return None
