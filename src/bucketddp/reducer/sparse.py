"""Sparse gradients: embeddings with ``sparse=True``.

A sparse gradient gets no bucket slot. It stays in ``.grad`` and is averaged in place just
before the last bucket is launched, which counts it among the gradients it waits for. A
sparse parameter with no gradient since the last synced backward (unused, or frozen)
sends an empty one, so that every rank launches the same collectives.

The average is built from two dense all-gathers, not from ``all_reduce`` on a sparse
tensor: gloo's sparse all-reduce corrupts the process's heap now and then when two are in
flight (torch 2.13), which ends the rank with a segfault or an abort. First every rank's
row counts are gathered, in a blocking call, since the second gather's size depends on
them. Then every rank's indices and values, packed as bytes and padded to the largest
rank's, in one all-gather that runs beside the last bucket. Each rank sums the ranks'
gradients in rank order and coalesces the sum: the arithmetic of gloo's sparse all-reduce,
so the result equals torch DDP's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

_ALIGN = 16  # bytes: every packed part starts at a multiple of this, so any dtype views it


class SparseGradients:
    """The planned parameters with sparse gradients, and their reduction in flight."""

    collectives = 2  # per step: the row counts, then the packed indices and values

    def __init__(
        self,
        indices: list[int],
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        group: dist.ProcessGroup | None,
    ) -> None:
        self.indices = indices
        self.params = params
        self.names = names
        self._group = group
        # What each parameter sent in the step in flight (its .grad, or an empty tensor):
        # the tensors that take the average, in place.
        self.sent: list[torch.Tensor] = []
        self._work: dist.Work | None = None
        self._received: list[torch.Tensor] = []
        self._counts: list[list[list[int]]] = []  # [rank][parameter] = [nnz, sparse_dim]
        self._dims: list[int] = []  # per parameter: its gradients' sparse dimensions
        self._shapes: list[list[_Part]] = []  # [rank][parameter]: what that rank sent
        self._wire = 0

    def launch(self, used: list[bool], divisor: int) -> None:
        """Start averaging each sparse gradient over ``divisor`` ranks, in place.

        A ``.grad`` left from earlier steps (the parameter is not ``used`` since the last
        synced backward) is not sent, nor changed.
        """
        grads = []
        for i in self.indices:
            grad = self.params[i].grad if used[i] else None
            if grad is None:
                grad = empty_like(self.params[i])
            else:
                grad.div_(divisor)  # torch DDP's arithmetic for sparse gradients
            grads.append(grad)
        self._start(grads)

    def launch_stand_ins(self) -> None:
        """A joined rank's part in a step: empty gradients through the same collectives."""
        self._start([empty_like(self.params[i]) for i in self.indices])

    def _start(self, grads: list[torch.Tensor]) -> None:
        self.sent = grads
        local = [g.coalesce() for g in grads]
        device = local[0].device
        world = dist.get_world_size(self._group)
        mine = torch.tensor(
            [[t._nnz(), t.sparse_dim()] for t in local], dtype=torch.long, device=device
        )
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=self._group)
        self._counts = [g.tolist() for g in gathered]
        self._agree_dims()
        self._shapes = [self._parts(rank) for rank in range(world)]
        width = max(max(_packed_bytes(parts) for parts in self._shapes), _ALIGN)
        payload = torch.zeros(width, dtype=torch.uint8, device=device)
        offset = 0
        for t in local:
            for part in (t._indices(), t._values()):
                raw = part.contiguous().reshape(-1).view(torch.uint8)
                payload[offset : offset + raw.numel()] = raw
                offset += _aligned(raw.numel())
        self._received = [torch.empty_like(payload) for _ in range(world)]
        self._wire = mine.numel() * mine.element_size() + width
        self._work = dist.all_gather(self._received, payload, group=self._group, async_op=True)

    def _agree_dims(self) -> None:
        """Each gradient's sparse dimensions, as the ranks that sent rows have them."""
        self._dims = []
        for p, i in enumerate(self.indices):
            dims = {counts[p][1] for counts in self._counts if counts[p][0] > 0}
            if len(dims) > 1:
                raise RuntimeError(
                    f"the sparse gradient of {self.names[i]!r} has {sorted(dims)} sparse "
                    "dimensions on different ranks; every rank must compute it the same way"
                )
            self._dims.append(dims.pop() if dims else self._counts[0][p][1])

    def _parts(self, rank: int) -> list[_Part]:
        """The shapes of ``rank``'s indices and values, and the values' dtype, per parameter."""
        shapes = []
        for p, i in enumerate(self.indices):
            nnz, sparse_dim = self._counts[rank][p][0], self._dims[p]
            param = self.params[i]
            values = torch.Size((nnz, *param.shape[sparse_dim:]))
            shapes.append((torch.Size((sparse_dim, nnz)), values, param.dtype))
        return shapes

    def wait(self) -> None:
        """Wait for the gradients of this step, and write each average into its tensor."""
        if self._work is None:
            return
        self._work.wait()
        self._work = None
        received = zip(self._shapes, self._received, strict=True)
        ranks = [_unpack(parts, buffer) for parts, buffer in received]
        with torch.no_grad():
            for p, sent in enumerate(self.sent):
                total = _coo(*ranks[0][p], sent.shape)
                for parts in ranks[1:]:
                    total += _coo(*parts[p], sent.shape)
                sent.copy_(total.coalesce())
        self._received = []
        self._shapes = []

    def take_used(self, used_anywhere: list[bool]) -> None:
        """find_unused_parameters: a parameter unused here but used elsewhere takes the average."""
        for i, sent in zip(self.indices, self.sent, strict=True):
            if used_anywhere[i] and self.params[i].grad is not sent:
                self.params[i].grad = sent

    def reset(self) -> None:
        """Forget the step in flight."""
        self.sent = []
        self._work = None
        self._received = []
        self._shapes = []

    def nbytes(self) -> int:
        """Bytes this rank put on the wire for the step's sparse gradients."""
        return self._wire


_Part = tuple[torch.Size, torch.Size, torch.dtype]  # indices' shape, values' shape and dtype


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _packed_bytes(parts: list[_Part]) -> int:
    """The bytes one rank's gradients take in the payload, each part aligned."""
    total = 0
    for ind, val, dtype in parts:
        total += _aligned(ind.numel() * torch.long.itemsize)
        total += _aligned(val.numel() * dtype.itemsize)
    return total


def _unpack(parts: list[_Part], buffer: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One rank's indices and values, copied out of its received ``buffer``."""
    out = []
    offset = 0
    for ind, val, dtype in parts:
        indices, offset = _take(buffer, offset, torch.long, ind)
        values, offset = _take(buffer, offset, dtype, val)
        out.append((indices, values))
    return out


def _take(
    buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size
) -> tuple[torch.Tensor, int]:
    """The tensor of ``dtype`` and ``shape`` packed at ``offset`` in ``buffer``; the next offset."""
    nbytes = shape.numel() * dtype.itemsize
    part = buffer[offset : offset + nbytes].view(dtype).reshape(shape).clone()
    return part, offset + _aligned(nbytes)


def _coo(indices: torch.Tensor, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=False)


def empty_like(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient for ``param`` (an embedding's weight) with no rows: it adds nothing."""
    indices = torch.empty(1, 0, dtype=torch.long, device=param.device)
    values = torch.empty(0, *param.shape[1:], dtype=param.dtype, device=param.device)
    return _coo(indices, values, param.shape)
