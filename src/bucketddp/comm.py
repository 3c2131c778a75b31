"""Coalesced collectives over lists of tensors, and the same-model check.

Tensors are packed into one flat tensor (per dtype and device for reductions, per device for
broadcasts), so a list of any length costs one collective rather than one per tensor.
"""

from __future__ import annotations

import itertools
import pickle
import zlib
from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .naming import name_list


def global_rank(group: dist.ProcessGroup | None, group_rank: int = 0) -> int:
    """The global rank of the group's ``group_rank``, as ``src`` arguments expect."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


class AsyncSum:
    """Launches asynchronous SUM all-reduces on one process group, for the gradient buckets.

    ``dist.all_reduce`` looks the group up, checks its tensor and builds its options on
    every call. A bucket is launched from inside backward, where that Python runs with cold
    caches between autograd's kernels, so that work is done once, at construction. The
    collective is the same one: the group's own ``allreduce``, which ``dist.all_reduce``
    calls in the end.

    Complex tensors are not handled here (``dist.all_reduce`` sends their real view): the
    reducer hands over the real view of a complex bucket itself (see ``on_wire``).
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        world = dist.group.WORLD if group is None else group
        if world is None:
            raise RuntimeError("torch.distributed is not initialized: no default process group")
        self.group = world
        self._opts = dist.AllreduceOptions()
        self._opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        if hasattr(self._opts, "asyncOp"):  # torch >= 2.7; before, every call was async
            self._opts.asyncOp = True

    def __call__(self, tensor: torch.Tensor) -> dist.Work:
        """Start summing ``tensor`` in place over the group; returns the work to wait on."""
        return self.group.allreduce([tensor], self._opts)


def private_copy(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new process group with the ranks of ``group`` (None: the default group).

    Its collectives keep an order of their own, apart from those on ``group``. Making it is
    a collective over those ranks: every one of them calls this, at the same point. It
    lives as long as it is referenced, and ``dist.destroy_process_group()`` ends it with
    the others.
    """
    base = group if group is not None else dist.group.WORLD
    private = dist.new_group(dist.get_process_group_ranks(base), use_local_synchronization=True)
    if not isinstance(private, dist.ProcessGroup):  # only a non-member gets none
        raise RuntimeError("this rank is not a member of the group it copies")
    return private


def on_wire(t: torch.Tensor) -> torch.Tensor:
    """What a reduction sends for ``t``: its real view if complex (as ``dist.all_reduce``)."""
    return torch.view_as_real(t) if t.is_complex() else t


class FlatTensors:
    """One flat buffer standing for a fixed list of tensors on one device, reused per sync.

    Packing is one ``torch.cat`` and unpacking one ``torch._foreach_copy_`` between 1-D views
    of the tensors and slices of the flat buffer, so a sync's cost in Python does not grow
    with the number of tensors. With ``as_bytes`` the tensors may have different dtypes
    (for a broadcast, which copies bytes); without it they must share one (for reductions).
    Tensors that are not contiguous take a slower per-tensor path.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], *, as_bytes: bool) -> None:
        self.tensors = list(tensors)
        self._as_bytes = as_bytes
        self._views = [_flat_view(t, as_bytes) for t in self.tensors]
        sizes = [t.numel() * (t.element_size() if as_bytes else 1) for t in self.tensors]
        dtype = torch.uint8 if as_bytes else self.tensors[0].dtype
        self.flat = torch.empty(sum(sizes), dtype=dtype, device=self.tensors[0].device)
        self._slices = list(self.flat.split(sizes))
        self._simple = all(v is not None for v in self._views)
        self._places = [(t.data_ptr(), t.shape) for t in self.tensors]

    def is_for(self, tensors: Sequence[torch.Tensor | None]) -> bool:
        """Whether this packing still describes exactly ``tensors``.

        The same objects, with the same memory and shape: a tensor given other memory in
        place (``buf.data = ...``, ``buf.resize_(...)``) needs a new packing, since the
        packing's views of it would still point at the old memory.
        """
        return len(tensors) == len(self.tensors) and all(
            a is b and a.data_ptr() == ptr and a.shape == shape
            for a, b, (ptr, shape) in zip(tensors, self.tensors, self._places, strict=True)
        )

    @torch.no_grad()
    def pack(self) -> torch.Tensor:
        """Copy the tensors into the flat buffer and return it."""
        if self._simple:
            torch.cat(self._views, out=self.flat)  # type: ignore[arg-type]
        else:
            for t, view, part in zip(self.tensors, self._views, self._slices, strict=True):
                part.copy_(view if view is not None else _flat_view(t.contiguous(), self._as_bytes))
        return self.flat

    @torch.no_grad()
    def unpack(self) -> None:
        """Copy the flat buffer's contents back into the tensors."""
        if self._simple:
            torch._foreach_copy_(self._views, self._slices)  # type: ignore[arg-type]
            return
        for t, view, part in zip(self.tensors, self._views, self._slices, strict=True):
            if view is not None:
                view.copy_(part)
            elif self._as_bytes:  # a fresh copy is aligned for any dtype
                t.copy_(part.clone().view(t.dtype).view(t.shape))
            else:
                t.copy_(part.view(t.shape))


def _flat_view(t: torch.Tensor, as_bytes: bool) -> torch.Tensor | None:
    """A 1-D view sharing ``t``'s memory (as bytes if asked), or None if ``t`` has gaps."""
    if not t.is_contiguous():
        return None
    flat = t.detach().view(-1)
    return flat.view(torch.uint8) if as_bytes else flat


def _by_device(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return list(groups.values())


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def broadcast_packed(
    packed: FlatTensors, group: dist.ProcessGroup | None = None, *, src: int = 0
) -> int:
    """Give ``packed``'s tensors the values of group rank ``src`` with one broadcast; returns 1."""
    dist.broadcast(packed.pack(), src=global_rank(group, src), group=group)
    packed.unpack()
    return 1


def all_reduce_packed(
    packed: FlatTensors,
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup | None = None,
    *,
    divide_by: int = 1,
    identity: float | None = None,
) -> int:
    """All-reduce ``packed``'s tensors with one collective, optionally dividing; returns 1.

    With ``identity`` this rank adds nothing of its own: it contributes ``op``'s identity
    element (0 for a sum, the lowest value for a max, ...) and takes the others' result.
    """
    flat = packed.pack() if identity is None else packed.flat.fill_(identity)
    wide = flat
    if divide_by != 1 and flat.is_floating_point() and flat.element_size() < 4:
        # A mean of half-precision values: their sum may pass the dtype's largest value
        # (65504 in float16, float32's in bfloat16) where the mean does not, so it is
        # taken in float64.
        wide = flat.double()
    dist.all_reduce(wide, op=op, group=group)
    if divide_by != 1:
        wide.div_(divide_by)
    if wide is not flat:
        flat.copy_(wide)
    packed.unpack()
    return 1


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None, *, src: int = 0
) -> int:
    """Overwrite ``tensors`` in place with group rank ``src``'s values; returns collectives used.

    A broadcast copies bytes, so tensors of every dtype on one device travel together:
    one collective per device, where a per-dtype scheme needs one per dtype (BatchNorm's
    float statistics and int64 counter, say).
    """
    members = _by_device([t for t in tensors if t.numel()])
    return sum(broadcast_packed(FlatTensors(m, as_bytes=True), group, src=src) for m in members)


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup | None = None,
) -> int:
    """All-reduce ``tensors`` in place with ``op``, one collective per dtype; returns the count."""
    members = _by_dtype([t for t in tensors if t.numel()])
    return sum(all_reduce_packed(FlatTensors(m, as_bytes=False), op, group) for m in members)


_KEPT: deque[dist.Work] = deque(maxlen=8)


def wait_kept(work: dist.Work | None) -> None:
    """Wait for ``work`` and keep it referenced from Python, so that Python frees it.

    A gloo work holds Python objects: its tensors, and the thread-local state it was
    launched under. Dropped by Python first, the work is freed by gloo's worker thread,
    which must then take the GIL; if the interpreter is already exiting (an error raised
    just after the collective), Python ends that thread inside a C++ destructor and the
    process dies of SIGABRT ("terminate called without an active exception"). Kept here,
    the worker's release is never the last one: the last few works are freed by Python,
    when newer ones push them out or when the interpreter clears this module.
    """
    if work is not None:
        work.wait()
        _KEPT.append(work)


def all_reduce_kept(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> None:
    """``dist.all_reduce``, blocking, with its work kept (see ``wait_kept``): for the
    collectives whose result may make every rank raise."""
    wait_kept(dist.all_reduce(tensor, op=op, group=group, async_op=True))


def _all_gather_bytes(
    data: bytes, group: dist.ProcessGroup | None, device: torch.device
) -> list[bytes]:
    """Every rank's ``data``: ``all_gather_object`` for bytes, with its works kept (see
    ``wait_kept``), as the collectives before a cross-rank error must be."""
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    wait_kept(dist.all_gather(sizes, size, group=group, async_op=True))
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    wait_kept(dist.all_gather(gathered, mine, group=group, async_op=True))
    return [bytes(g[: int(s.item())].cpu().tolist()) for g, s in zip(gathered, sizes, strict=True)]


def gather_if_different(
    obj: object, group: dist.ProcessGroup | None, device: torch.device
) -> list[object] | None:
    """Every rank's ``obj`` when some rank's differs from the others', else None.

    A fingerprint of ``repr(obj)`` (its length and two checksums) goes first: one MAX
    all-reduce of the fingerprint and its negation, on a ``device`` tensor, gives the
    largest and the smallest fingerprint, equal exactly when every rank's is the same.
    Only when they differ do the pickled objects follow, so that the caller can name the
    difference. Every rank decides from the same reduced values, so either all of them
    take part in that second collective or none does. The common case, equal objects,
    pickles nothing: pickling runs code a training step never needs, whose pages count in
    the process's resident memory. The works are kept (``wait_kept``): a caller raises
    right after a difference, and the process may exit at once.
    """
    text = repr(obj).encode()
    fingerprint = [len(text), zlib.crc32(text), zlib.adler32(text)]
    extremes = torch.tensor(
        fingerprint + [-v for v in fingerprint], dtype=torch.int64, device=device
    )
    all_reduce_kept(extremes, group, dist.ReduceOp.MAX)
    values = extremes.tolist()
    if values[:3] == [-v for v in values[3:]]:
        return None
    return [pickle.loads(b) for b in _all_gather_bytes(pickle.dumps(obj), group, device)]


def module_device(module: torch.nn.Module, group: dist.ProcessGroup | None) -> torch.device:
    """Where the wrapper's own small collectives go: the device of the module's first
    parameter or buffer (the one it communicates from), else the group's object device."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def verify_same_model(
    signature: list[tuple[str, str, tuple[int, ...], str]],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Raise on every rank if any rank's (kind, name, shape, dtype) list differs from rank 0's.

    Every rank takes part in the same collectives (see ``gather_if_different``; ``device``
    is where its tensors go), so a mismatch is reported everywhere and no rank is left
    waiting in a later collective.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    gathered = gather_if_different(signature, group, device)
    if gathered is None:
        return
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


IGNORED_KIND = "ignored name"
"""The kind of a signature entry that names a member of the module's ignore list."""


def _first_difference(ref: list, other: list) -> str | None:
    ignored = [[e[1] for e in sig if e[0] == IGNORED_KIND] for sig in (ref, other)]
    if ignored[0] != ignored[1]:
        return (
            f"it ignores {name_list(ignored[1])} where rank 0 ignores {name_list(ignored[0])}; "
            "_ddp_params_and_buffers_to_ignore must list the same names on every rank"
        )
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
