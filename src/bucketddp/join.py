"""Uneven inputs: what a rank that ran out of batches does while the others still train.

``BucketDataParallel.join()`` returns torch's ``Join`` context manager
(``torch.distributed.algorithms.join``) with the wrapper as its ``Joinable``. Inside it,
every forward of a rank still training starts with Join's notification and then one small
all-reduce, the *step header*, which tells every rank three things about the iteration:
which ranks still train, whether buffers are synced before this forward, and whether a
synced backward follows. A rank that has joined answers each iteration in ``main_hook``:
it reads the same header, takes part in the buffer sync without adding its own values, and
contributes zeros to every gradient bucket (``Reducer.shadow_backward``). When every rank
has joined, ``post_hook`` gives every rank the parameters and broadcast buffers of a rank
that joined last, as torch DDP does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import JoinHook

from .comm import broadcast_coalesced

if TYPE_CHECKING:
    from .parallel import BucketDataParallel


@dataclass(frozen=True)
class JoinStep:
    """One iteration under ``join()``, as every rank learns it from the step header."""

    ranks: int
    """How many ranks still train (have not joined)."""
    src: int
    """The highest group rank still training: ``"broadcast"`` buffers take its values."""
    sync_buffers: bool
    """Buffers are synced before this forward."""
    sync_backward: bool
    """A synced backward follows this forward (not ``no_sync()``, not ``torch.no_grad()``)."""


def header(
    rank: int | None, world_size: int, *, sync_buffers: bool, sync_backward: bool
) -> list[float]:
    """This rank's part of the step header; ``rank`` is None on a rank that has joined.

    The header is summed over ranks: one slot per rank (1 if it still trains), then the
    number of training ranks that sync buffers, then those that sync the backward.
    """
    part = [0.0] * (world_size + 2)
    if rank is not None:
        part[rank] = 1.0
        part[world_size] = float(sync_buffers)
        part[world_size + 1] = float(sync_backward)
    return part


def read_header(summed: Sequence[float], world_size: int) -> JoinStep:
    """The iteration a summed step header describes.

    Raises:
        RuntimeError: the training ranks disagree on syncing buffers or the backward, which
            would leave some of them waiting on collectives the others never start.
    """
    training = [r for r in range(world_size) if round(summed[r]) == 1]
    if not training:
        raise RuntimeError("bucketddp join: a step header with no training rank")
    step = JoinStep(
        ranks=len(training),
        src=training[-1],
        sync_buffers=round(summed[world_size]) > 0,
        sync_backward=round(summed[world_size + 1]) > 0,
    )
    for what, count in (
        ("sync buffers before the forward", summed[world_size]),
        ("sync the backward", summed[world_size + 1]),
    ):
        if round(count) not in (0, step.ranks):
            raise RuntimeError(
                f"BucketDataParallel.join: {round(count)} of the {step.ranks} ranks still "
                f"training {what} in this iteration, the others do not. Under join() every "
                "training rank must run the same kind of step: use no_sync() and "
                "torch.no_grad() alike on every rank, and follow each grad-enabled forward by "
                "one backward."
            )
    return step


def exchange_header(
    part: list[float], group: dist.ProcessGroup | None, device: torch.device, world_size: int
) -> JoinStep:
    """Sum the step header over the group (one blocking all-reduce) and read it."""
    summed = torch.tensor(part, dtype=torch.float32, device=device)
    dist.all_reduce(summed, group=group)
    return read_header(summed.tolist(), world_size)


def last_joiner(candidate: bool, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The highest group rank among those with ``candidate`` set (one all-reduce)."""
    rank = torch.tensor([dist.get_rank(group) if candidate else -1], device=device)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=group)
    return int(rank.item())


def check_joinable(module: nn.Module) -> None:
    """Refuse modules that communicate inside their forward, which a joined rank cannot match.

    Raises:
        ValueError: naming the SyncBatchNorm layers.
    """
    from .syncbn import syncbn_layers

    layers = syncbn_layers(module)
    if layers:
        raise ValueError(
            f"BucketDataParallel.join: SyncBatchNorm layers {layers[:5]} all-reduce inside "
            "the forward pass, which a rank that ran out of inputs cannot match, so uneven "
            "inputs are not supported with them. Give every rank the same number of batches "
            "(DistributedSampler with drop_last=True), or use BatchNorm with a buffer policy."
        )


class BucketJoinHook(JoinHook):
    """Shadows a ``BucketDataParallel`` iteration on a rank that has joined."""

    def __init__(self, wrapper: BucketDataParallel) -> None:
        self.wrapper = wrapper
        self.world_size = wrapper.reducer.world_size

    def main_hook(self) -> None:
        """Match one iteration of the ranks still training: header, buffers, backward."""
        w = self.wrapper
        part = header(None, self.world_size, sync_buffers=False, sync_backward=False)
        step = exchange_header(part, w.process_group, w.join_device, self.world_size)
        if step.sync_buffers:
            w.buffers_sync.sync(src=step.src, ranks=step.ranks, contribute=False)
        if step.sync_backward:
            w.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Give every rank the parameters and broadcast buffers of a rank that joined last."""
        w = self.wrapper
        src = last_joiner(is_last_joiner, w.process_group, w.join_device)
        tensors = [*(p for _, p in w._named_parameters()), *w.buffers_sync.broadcast_buffers()]
        with torch.no_grad():
            broadcast_coalesced(tensors, w.process_group, src=src)
        w._end_join()
