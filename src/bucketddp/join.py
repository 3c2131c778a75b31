"""Uneven inputs: what a rank that ran out of batches does while the others still train.

``BucketDataParallel.join()`` returns torch's ``Join`` context manager
(``torch.distributed.algorithms.join``) with the wrapper as its ``Joinable``. Inside it,
every forward of a rank still training starts with Join's notification and then one small
all-reduce, the *step header*, which tells every rank three things about the iteration:
which ranks still train, whether buffers are synced before this forward, and whether a
synced backward follows. A rank that has joined answers each iteration in ``main_hook``:
it reads the same header, takes part in the buffer sync without adding its own values, and
contributes zeros to every gradient bucket (``reducer/shadow.py``). When every rank
has joined, ``post_hook`` gives every rank the parameters and broadcast buffers of a rank
that joined last, as torch DDP does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from .buffers import BufferSync
from .comm import all_reduce_kept, broadcast_coalesced, wait_kept
from .naming import name_list
from .reducer import Reducer
from .reducer.shadow import shadow_backward


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
    all_reduce_kept(summed, group)  # read_header may raise on every rank
    return read_header(summed.tolist(), world_size)


def last_joiner(candidate: bool, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The highest group rank among those with ``candidate`` set (one all-reduce)."""
    rank = torch.tensor([dist.get_rank(group) if candidate else -1], device=device)
    all_reduce_kept(rank, group, dist.ReduceOp.MAX)
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
            f"BucketDataParallel.join: SyncBatchNorm layers {name_list(layers)} all-reduce inside "
            "the forward pass, which a rank that ran out of inputs cannot match, so uneven "
            "inputs are not supported with them. Give every rank the same number of batches "
            "(DistributedSampler with drop_last=True), or use BatchNorm with a buffer policy."
        )


def training_step(
    reducer: Reducer,
    buffers: BufferSync,
    device: torch.device,
    *,
    sync_buffers: bool,
    divide_by_initial_world_size: bool,
    notified: Any = None,
) -> None:
    """On a rank still training, before a forward: exchange the step header, sync buffers.

    The joined ranks learn from the header what this iteration does; the reducer learns
    how many ranks send gradients, and over how many they are averaged. ``notified`` is
    Join's notification in flight, waited for once the header is exchanged.
    """
    world_size = reducer.world_size
    part = header(
        reducer.rank,
        world_size,
        sync_buffers=sync_buffers,
        sync_backward=torch.is_grad_enabled() and reducer.sync_enabled,
    )
    step = exchange_header(part, reducer.process_group, device, world_size)
    wait_kept(notified)
    if step.sync_buffers:
        buffers.sync(src=step.src, ranks=step.ranks)
    if step.sync_backward:
        divisor = world_size if divide_by_initial_world_size else step.ranks
        reducer.set_training_ranks(step.ranks, divisor)


@dataclass
class BucketJoinHook(JoinHook):
    """Shadows an iteration of the ranks still training, on a rank that has joined."""

    reducer: Reducer
    """The wrapper's reducer."""
    buffers: BufferSync
    """The wrapper's buffer sync."""
    device: torch.device
    """Where the join's own collectives run (the module's device)."""
    params: Callable[[], list[nn.Parameter]]
    """The parameters every rank takes from a rank that joined last."""
    on_end: Callable[[], None]
    """Called on every rank once every rank has joined."""

    def main_hook(self) -> None:
        """Match one iteration of the ranks still training: header, buffers, backward."""
        world_size = self.reducer.world_size
        part = header(None, world_size, sync_buffers=False, sync_backward=False)
        step = exchange_header(part, self.reducer.process_group, self.device, world_size)
        if step.sync_buffers:
            self.buffers.sync(src=step.src, ranks=step.ranks, contribute=False)
        if step.sync_backward:
            shadow_backward(self.reducer)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Give every rank the parameters and broadcast buffers of a rank that joined last."""
        group = self.reducer.process_group
        src = last_joiner(is_last_joiner, group, self.device)
        tensors = [*self.params(), *self.buffers.broadcast_buffers()]
        with torch.no_grad():
            broadcast_coalesced(tensors, group, src=src)
        world_size = self.reducer.world_size
        self.reducer.set_training_ranks(world_size, world_size)
        self.on_end()


class JoinableWrapper(Joinable):
    """``BucketDataParallel``'s side of torch's ``Join``: ``join()`` and the ``Joinable``
    interface. The wrapper's forward runs ``training_step`` while a join is on."""

    module: nn.Module
    reducer: Reducer
    buffers_sync: BufferSync
    process_group: dist.ProcessGroup | None
    _divide_by_initial_world_size: bool
    _sync_buffers_next: bool

    if TYPE_CHECKING:

        def _named_parameters(self) -> list[tuple[str, nn.Parameter]]: ...

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """A context manager for uneven inputs: ranks may run out of batches at different steps.

        Torch DDP's ``join()``: ``with model.join(): for batch in loader: ...``. A rank that
        runs out of batches matches the collectives of the ranks still training, contributing
        zero gradients, until every rank is done; then every rank takes the parameters (and
        broadcast buffers) of a rank that joined last. Every grad-enabled forward inside it
        must be followed by one backward. See ``docs/uneven-inputs.md``.

        Args:
            divide_by_initial_world_size: average gradients over the world size (True, the
                default: every sample weighs the same) or over the ranks still training.
            enable: False makes the context manager do nothing (inputs known to be even).
            throw_on_early_termination: raise a RuntimeError on every rank as soon as one
                rank runs out of batches, instead of training on.

        Raises:
            ValueError: the module has SyncBatchNorm layers, whose forward communicates.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook torch's ``Join`` runs on a rank that has joined (``Joinable`` interface).

        Takes ``divide_by_initial_world_size`` (default True) from ``Join``'s keyword
        arguments.
        """
        check_joinable(self.module)
        self._divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))
        return BucketJoinHook(
            self.reducer,
            self.buffers_sync,
            self.join_device,
            lambda: [p for _, p in self._named_parameters()],
            self._end_join,
        )

    @property
    def join_device(self) -> torch.device:
        """The device of the join context's own collectives: the module's (``Joinable``)."""
        return next(iter(self.reducer.all_params)).device

    @property
    def join_process_group(self) -> Any:
        """The process group of the join context's collectives (``Joinable``)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _end_join(self) -> None:
        """Leave join mode, once every rank has joined."""
        self._join_config = self._join_config._replace(enable=False)
        self._sync_buffers_next = True
