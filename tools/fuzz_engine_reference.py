"""The engine fuzzer's ground truth: one process that trains a schedule on the global batch.

``reference`` gives the parameters after each step and at the end, and each rank's buffers,
as BucketDataParallel on ``schedule.world`` ranks must leave them:

- **Gradients.** Each step, every rank still training adds its loss, divided by the world
  size (or, under ``join(divide_by_initial_world_size=False)`` without a communication hook,
  by the number of ranks still training), and backward runs once per rank's batch, so
  BatchNorm sees each rank's batch as the rank does. ``no_sync()`` micro-batches accumulate
  the same way. SGD with momentum 0.9 then steps, and ``zero_grad`` uses the step's
  ``set_to_none``. A parameter that no rank uses keeps its ``.grad``, in both systems.
- **Buffers** (BatchNorm's, and those of an optional ``Stats`` block that counts samples
  and tokens, accumulates, keeps an EMA, a running maximum and minimum, a per-rank value,
  a value for a custom policy and two flags, all updated in forward and read by it). Each
  rank starts from its own values (rank-dependent, set before wrapping). The policies come
  from ``buffer_sync`` rules (exact names and fnmatch patterns, including the custom
  functions ``median_of_ranks`` and ``weighted_mean_of_ranks``), ``default_buffer_policy``,
  ``broadcast_buffers``/``forward_sync_buffers`` and SyncBatchNorm's own ``"none"``. The
  reference resolves them by docs/buffers.md's precedence itself, keeps each rank's
  buffers, and applies docs/buffers.md's semantics: at wrapping every buffer but the
  rank-local ``"none"`` ones takes rank 0's value; before the first forward and before
  each forward that follows a synced one, ``"broadcast"`` takes rank 0's values (under
  ``join()``: the highest rank still training), ``"mean"``/``"max"``/``"min"`` reduce over
  the ranks still training, ``"sum"`` adds every rank's change since the last agreed value
  to it, and a custom function sees every rank's buffer; at the end of ``join()`` the
  ``"broadcast"`` buffers take the values of the highest rank that trained last. Every
  rank's buffers are compared after each step it trains and at the end.
- **SyncBatchNorm** (``convert_sync_batchnorm`` on the BatchNorm layer). The reference runs
  the input layer and plain BatchNorm on the concatenation of the ranks' batches, once per
  rank's running statistics, then the rest of the model on each rank's share, and one
  backward through the sum of the losses.
- **Checkpointing** (``torch.utils.checkpoint``, reentrant or not, only on the ranks). The
  trunk runs in a segment per layer or in one, optionally ``trunk.0`` again at its end and
  the head in a segment of its own; a forward may return an object the wrapper's output
  hooks do not open. Recomputing changes nothing, so the reference runs plainly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fuzz_engine_model import (
    LR,
    MOMENTUM,
    FuzzNet,
    batch,
    buffers_of,
    build_model,
    loss_of,
    params_of,
    rank_values,
    set_target,
    weighted_mean,
)
from fuzz_engine_schedule import Schedule, Step


def reference(s: Schedule, precise: bool = False) -> dict[str, Any]:
    """One process on the global batch: parameters after each step and at the end, buffers
    by rank after each step and at the end.

    ``precise`` trains in float64 throughout; the difference from the float32 run tells how
    far float rounding alone moves each tensor (see ``compare``).
    """
    model = build_model(s)
    if precise:
        model.double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    policies = s.buffer_policies()
    start = buffers_of(model)
    if start.keys() != policies.keys():
        raise AssertionError(f"buffers {sorted(start)} but policies for {sorted(policies)}")
    # At wrapping every buffer takes rank 0's value, except the rank-local "none" ones.
    rank_buffers = [rank_values(start, r) for r in range(s.world)]
    for name, (_, local) in policies.items():
        for r in range(1, s.world):
            if not local:
                rank_buffers[r][name] = rank_buffers[0][name].clone()
    # "sum": the value every rank last agreed on.
    agreed = {n: rank_buffers[0][n].clone() for n, (p, _) in policies.items() if p == "sum"}
    sync_next = True  # before the first forward, and after each synced one
    snapshots, buffer_snapshots = [], []
    for i, step in enumerate(s.steps):
        training = [r for r in range(s.world) if s.batches[r] > i]
        # A communication hook divides by itself (allreduce_hook: by the group's size).
        by_world = not s.join or s.by_initial or s.hook
        divisor = s.world if by_world else len(training)
        set_target(model, s, step.target_trains)
        for m in range(step.micro):
            if sync_next:
                # Under join() "broadcast" takes the highest rank still training.
                src = training[-1] if s.join else 0
                _sync_reference(policies, rank_buffers, agreed, training, src)
            inputs = {}
            for r in training:
                x, tokens, y, labels = batch(s, i, m, r)
                if precise:
                    x, y = x.double(), y.double()
                inputs[r] = (x, tokens, y, labels)
            if s.syncbn:
                _global_bn_step(model, s, step, m, inputs, rank_buffers, divisor)
            else:
                for r in training:
                    x, tokens, y, labels = inputs[r]
                    _load_buffers(model, rank_buffers[r])
                    out = model(x, tokens, step.branch[m][r], step.lookup[m][r])
                    (loss_of(out, y, labels) / divisor).backward()
                    rank_buffers[r] = buffers_of(model)
            sync_next = m == step.micro - 1
        opt.step()
        opt.zero_grad(set_to_none=step.set_to_none)
        snapshots.append(params_of(model))
        buffer_snapshots.append([dict(b) for b in rank_buffers])
    if s.join:
        # At the end of join(), "broadcast" buffers take a last joiner's values.
        last = max(r for r in range(s.world) if s.batches[r] == len(s.steps))
        for name, (policy, _) in policies.items():
            if policy == "broadcast":
                for r in range(s.world):
                    rank_buffers[r][name] = rank_buffers[last][name]
    return {
        "steps": snapshots,
        "step_buffers": buffer_snapshots,
        "params": params_of(model),
        "buffers": rank_buffers,
    }


def _sync_reference(
    policies: dict[str, tuple[str, bool]],
    rank_buffers: list[dict[str, torch.Tensor]],
    agreed: dict[str, torch.Tensor],
    training: Sequence[int],
    src: int,
) -> None:
    """One buffer sync as docs/buffers.md describes it, on every rank's values in place."""
    world = len(rank_buffers)
    for name, (policy, _) in policies.items():
        if policy == "none":
            continue
        values = [b[name] for b in rank_buffers]
        live = torch.stack([values[r] for r in training])
        if policy == "broadcast":
            new = [values[src]] * world
        elif policy == "sum":
            # Every rank's change since the last agreed value, including a joined rank's.
            base = agreed[name]
            total = base + torch.stack([v - base for v in values]).sum(0)
            agreed[name] = total
            new = [total] * world
        elif policy == "mean":
            new = [live.sum(0) / len(training)] * world
        elif policy == "max":
            new = [live.any(0) if live.dtype == torch.bool else live.amax(0)] * world
        elif policy == "min":
            new = [live.all(0) if live.dtype == torch.bool else live.amin(0)] * world
        elif policy == "median":  # median_of_ranks, on every rank's buffer (joined or not)
            new = [torch.stack(values).median(dim=0).values] * world
        elif policy == "wmean":  # weighted_mean_of_ranks, likewise
            new = [weighted_mean(values)] * world
        else:
            raise AssertionError(f"no reference for buffer policy {policy!r}")
        for r in range(world):
            rank_buffers[r][name] = new[r].clone()


def _global_bn_step(
    model: FuzzNet,
    s: Schedule,
    step: Step,
    m: int,
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    rank_buffers: list[dict[str, torch.Tensor]],
    divisor: int,
) -> None:
    """One forward and backward of every rank with SyncBatchNorm, as one process would.

    BatchNorm sees the concatenation of the ranks' batches: its output (batch statistics)
    is the same whatever running statistics it holds, so it runs once with autograd, and
    once more per other rank, without, to update that rank's running statistics from the
    global batch. The rest of the model runs on each rank's share with that rank's buffers,
    and one backward goes through the sum of the ranks' losses.
    """
    assert model.bn is not None
    ranks = list(inputs)
    h = model.inp(torch.cat([inputs[r][0] for r in ranks]))
    normed: torch.Tensor | None = None
    for r in ranks:
        _load_buffers(model, rank_buffers[r])
        if normed is None:
            normed = model.bn(h)
        else:
            with torch.no_grad():
                model.bn(h.detach())
        rank_buffers[r] = buffers_of(model)
    assert normed is not None
    total = torch.zeros((), dtype=normed.dtype)
    shares = normed.split([inputs[r][0].shape[0] for r in ranks])
    for r, share in zip(ranks, shares, strict=True):
        x, tokens, y, labels = inputs[r]
        _load_buffers(model, rank_buffers[r])
        out = model.rest(share, x, tokens, step.branch[m][r], step.lookup[m][r])
        total = total + loss_of(out, y, labels) / divisor
        rank_buffers[r] = buffers_of(model)
    total.backward()


def _load_buffers(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Give the model's buffers these values, as new tensors: a tensor that a forward saved
    for its backward (BatchNorm's running statistics) is left as it was."""
    for name, value in values.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = value.detach().clone()
