"""Sparse gradients: embeddings with ``sparse=True``.

A sparse gradient gets no bucket slot. It stays in ``.grad`` and is all-reduced on its
own, averaged and in place, just before the last bucket, which counts it among the
gradients it waits for. A sparse parameter with no gradient since the last synced
backward (unused, or frozen) sends an empty one, so that every rank launches the same
collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .storage import nbytes


class SparseGradients:
    """The planned parameters with sparse gradients, and their all-reduces in flight."""

    def __init__(
        self, indices: list[int], params: Sequence[torch.Tensor], group: dist.ProcessGroup | None
    ) -> None:
        self.indices = indices
        self.params = params
        self._group = group
        # What each parameter sent in the step in flight (its .grad, or an empty tensor),
        # and the all-reduces.
        self.sent: list[torch.Tensor] = []
        self._works: list[dist.Work] = []

    def launch(self, used: list[bool], divisor: int) -> None:
        """All-reduce each sparse gradient, averaged over ``divisor`` ranks, in place.

        A ``.grad`` left from earlier steps (the parameter is not ``used`` since the last
        synced backward) is not sent, nor changed.
        """
        self.sent = []
        self._works = []
        for i in self.indices:
            grad = self.params[i].grad if used[i] else None
            if grad is None:
                grad = empty_like(self.params[i])
            else:
                grad.div_(divisor)  # torch DDP's arithmetic for sparse gradients
            self.sent.append(grad)
            self._works.append(dist.all_reduce(grad, group=self._group, async_op=True))

    def wait(self) -> None:
        """Wait for the all-reduces launched in this step."""
        for work in self._works:
            work.wait()
        self._works = []

    def take_used(self, used_anywhere: list[bool]) -> None:
        """find_unused_parameters: a parameter unused here but used elsewhere takes the average."""
        for i, sent in zip(self.indices, self.sent, strict=True):
            if used_anywhere[i] and self.params[i].grad is not sent:
                self.params[i].grad = sent

    def stand_ins(self) -> list[torch.Tensor]:
        """Empty gradients for every sparse parameter (what a joined rank sends)."""
        return [empty_like(self.params[i]) for i in self.indices]

    def reset(self) -> None:
        """Forget the step in flight."""
        self.sent = []
        self._works = []

    def nbytes(self) -> int:
        """Bytes the step's sparse gradients put on the wire."""
        return sum(nbytes(g) for g in self.sent)


def empty_like(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient for ``param`` (an embedding's weight) with no rows: it adds nothing."""
    indices = torch.empty(1, 0, dtype=torch.long, device=param.device)
    values = torch.empty(0, *param.shape[1:], dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=False)
