"""Freezing and unfreezing parameters after wrapping, on real gloo process groups.

Ground truth is one process that averages the ranks' losses (the global batch) and applies
the same ``requires_grad`` schedule. torch DDP is no ground truth here: it ignores a
parameter unfrozen after wrapping, so the ranks drift apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from bucketddp import BucketDataParallel
from models import batch, build, split_flags
from multirank import run_ranks

Schedule = Callable[[int, int], bool]  # (rank, step) -> does the switched group require grad


def _switched(model: nn.Module, name: str) -> list[nn.Parameter]:
    if name == "branchy":
        return [*model.right.parameters(), *model.never.parameters()]
    return list(model.net[0].parameters())


def _unfreeze_at_2(rank: int, step: int) -> bool:
    return step >= 2


def _swap_at_2(rank: int, step: int) -> bool:
    # The first layer unfreezes as the last one freezes (fine-tuning that moves on): the
    # last stays in the plan, frozen, when the first joins it.
    return step >= 2


def _apply(model: nn.Module, name: str, schedule: Schedule, rank: int, t: int) -> None:
    """Set the switched group's requires_grad for step (or micro-batch) ``t``."""
    on = schedule(rank, t)
    for p in _switched(model, name):
        p.requires_grad_(on)
    if schedule is _swap_at_2:
        for p in model.net[4].parameters():
            p.requires_grad_(not on)


def _freeze_at_1_unfreeze_at_3(rank: int, step: int) -> bool:
    return step < 1 or step >= 3


def _frozen_at_micro_3(rank: int, micro: int) -> bool:
    # With two micro-batches a step: between the two of step 1.
    return micro < 3


def _left_on_even(rank: int, step: int) -> bool:
    return (rank + step) % 2 == 0


def _step(
    forward: Callable[[torch.Tensor, int], torch.Tensor], name: str, step: int, rank: int
) -> torch.Tensor:
    x, y = batch(name, step, rank)
    return F.mse_loss(forward(x, step), y)


def _train(
    rank: int,
    world: int,
    name: str,
    schedule: Schedule,
    opts: dict[str, Any],
    *,
    steps: int = 5,
    accumulate: int = 1,
    set_to_none: bool = True,
    per_micro: bool = False,
) -> dict[str, Any]:
    """Train with BucketDataParallel while ``schedule`` switches a group's requires_grad.

    ``opts`` go to the wrapper, but for ``comm_hook``: a hook to register on it.
    ``per_micro``: the schedule's second argument counts micro-batches, not steps.
    """
    model = build(name)
    _apply(model, name, schedule, rank, 0)
    opts = dict(opts)
    hook = opts.pop("comm_hook", None)
    wrapped = BucketDataParallel(model, **opts)
    if hook is not None:
        wrapped.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def forward(x: torch.Tensor, step: int) -> torch.Tensor:
        if name == "branchy":
            return wrapped(x, use_left=_left_on_even(rank, step))
        return wrapped(x)

    no_grad: list[list[str]] = []
    for step in range(steps):
        for micro in range(accumulate):
            _apply(model, name, schedule, rank, step * accumulate + micro if per_micro else step)
            last = micro == accumulate - 1
            with contextlib.nullcontext() if last else wrapped.no_sync():
                _step(forward, name, step * accumulate + micro, rank).backward()
        no_grad.append([n for n, p in model.named_parameters() if p.grad is None])
        # Which gradients live in bucket storage after this backward, of those that exist.
        storages = {b.storage.untyped_storage().data_ptr() for b in wrapped.reducer.buckets}
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        in_buckets = {n for n, g in grads.items() if g.untyped_storage().data_ptr() in storages}
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "plan": [n for b in wrapped.bucket_plan for n in b.names],
        "no_grad": no_grad,
        "in_buckets": in_buckets,
        "with_grad": set(grads),
    }


def _reference(
    name: str,
    world: int,
    schedule: Schedule,
    *,
    steps: int = 5,
    accumulate: int = 1,
    set_to_none: bool = True,
    per_micro: bool = False,
) -> dict[str, Any]:
    """One process: the mean of every rank's loss, the same requires_grad schedule."""
    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    no_grad: list[list[str]] = []
    for step in range(steps):
        for micro in range(accumulate):
            _apply(model, name, schedule, 0, step * accumulate + micro if per_micro else step)
            losses = []
            for rank in range(world):

                def forward(x: torch.Tensor, s: int, rank: int = rank) -> torch.Tensor:
                    if name == "branchy":
                        return model(x, use_left=_left_on_even(rank, s))
                    return model(x)

                losses.append(_step(forward, name, step * accumulate + micro, rank))
            (sum(losses) / world).backward()
        no_grad.append([n for n, p in model.named_parameters() if p.grad is None])
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "no_grad": no_grad,
    }


TINY = {"bucket_cap_mb": 0.002, "first_bucket_mb": 0.0005}  # many buckets
MID_WINDOW = {"accumulate": 2, "per_micro": True}
CASES: dict[str, tuple[str, Schedule, dict[str, Any], dict[str, Any]]] = {
    "unfreeze": ("mlp", _unfreeze_at_2, {}, {}),
    "unfreeze_tiny_buckets": ("mlp", _unfreeze_at_2, TINY, {}),
    # Before, hooking the plan anew raised torch's "cannot register a hook on a tensor that
    # doesn't require gradient" on the frozen last layer, at the end of that backward.
    "swap": ("mlp", _swap_at_2, {}, {}),
    "swap_static_graph": ("mlp", _swap_at_2, {"static_graph": True}, {}),
    # Averaged in plain all-reduce the first step, through the hook once in the buckets.
    "unfreeze_comm_hook": ("mlp", _unfreeze_at_2, {"comm_hook": allreduce_hook, **TINY}, {}),
    "unfreeze_no_view": ("mlp", _unfreeze_at_2, {"gradient_as_bucket_view": False}, {}),
    "unfreeze_with_no_sync": ("mlp", _unfreeze_at_2, {}, {"accumulate": 2}),
    "freeze_then_unfreeze": ("mlp", _freeze_at_1_unfreeze_at_3, {}, {}),
    "freeze_then_unfreeze_keep_grads": (
        "mlp",
        _freeze_at_1_unfreeze_at_3,
        TINY,
        {"set_to_none": False},
    ),
    "freeze_then_unfreeze_no_view": (
        "mlp",
        _freeze_at_1_unfreeze_at_3,
        {"gradient_as_bucket_view": False},
        {},
    ),
    # Frozen after the no_sync micro-batch of a step, before its synced one: the gradient
    # accumulated in the first is averaged. Before, each rank stepped on its own (with
    # find_unused_parameters=False; torch DDP raises there).
    "freeze_inside_no_sync": ("mlp", _frozen_at_micro_3, {}, MID_WINDOW),
    "freeze_inside_no_sync_no_view": (
        "mlp",
        _frozen_at_micro_3,
        {"gradient_as_bucket_view": False},
        MID_WINDOW,
    ),
    "freeze_inside_no_sync_find_unused": (
        "mlp",
        _frozen_at_micro_3,
        {"find_unused_parameters": True},
        MID_WINDOW,
    ),
    # "right" is unfrozen while control flow differs by rank; "never" is unfrozen but used
    # by no rank, so its gradient must stay None.
    "unfreeze_find_unused": ("branchy", _unfreeze_at_2, {"find_unused_parameters": True}, {}),
}


def _train_in_rows(rank: int, world: int, *args: Any, **kw: Any) -> dict[str, Any]:
    """``_train`` with each rank's flags in a row of its own, as past 256 ranks in bfloat16."""
    split_flags(lambda world_size: world_size)
    return _train(rank, world, *args, **kw)


@pytest.mark.parametrize("case", [*CASES, "freeze_then_unfreeze/rows", "unfreeze/rows"])
def test_requires_grad_changes_match_single_process(case: str) -> None:
    case, _, rows = case.partition("/")
    name, schedule, opts, kw = CASES[case]
    results = run_ranks(partial(_train_in_rows if rows else _train, **kw), 2, name, schedule, opts)
    expected = _reference(name, 2, schedule, **kw)
    for rank, r in enumerate(results):
        for n, p in expected["params"].items():
            diff = (r["params"][n] - p).abs().max().item()
            assert diff <= 1e-6, f"rank {rank} parameter {n} differs by {diff}"
        # Frozen, and unused everywhere, mean a gradient of None, step by step.
        assert r["no_grad"] == expected["no_grad"], rank
        # gradient_as_bucket_view holds for the parameters that joined the plan too.
        view = opts.get("gradient_as_bucket_view", True)
        assert r["in_buckets"] == (r["with_grad"] if view else set()), rank
    # Every parameter but "never" trained, so the comparison above can fail.
    start = dict(build(name).named_parameters())
    for n, p in start.items():
        assert torch.equal(p, expected["params"][n]) == n.startswith("never"), n
    # A group unfrozen on every rank joins the plan.
    assert set(results[0]["plan"]) == set(start)


def test_world_size_one_follows_requires_grad() -> None:
    results = run_ranks(_train, 1, "mlp", _freeze_at_1_unfreeze_at_3, {})
    expected = _reference("mlp", 1, _freeze_at_1_unfreeze_at_3)
    for n, p in expected["params"].items():
        assert torch.allclose(results[0]["params"][n], p, atol=1e-6, rtol=0), n
    assert results[0]["no_grad"] == expected["no_grad"]


def _unfreeze_on_rank1(rank: int, step: int) -> bool:
    return rank == 1 and step >= 1


def _freeze_on_rank1(rank: int, step: int) -> bool:
    return not (rank == 1 and step >= 1)


def _message(rank: int, world: int, schedule: Schedule) -> str:
    try:
        _train(rank, world, "mlp", schedule, {}, steps=3)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("schedule", [_unfreeze_on_rank1, _freeze_on_rank1])
def test_requires_grad_differing_between_ranks_fails_on_every_rank(schedule: Schedule) -> None:
    for rank, message in enumerate(run_ranks(_message, 2, schedule, timeout=60)):
        assert "requires_grad differs between ranks" in message, (rank, message)
        assert "net.0.weight (1 of 2)" in message, (rank, message)


def _unfrozen_but_unused_on_rank0(rank: int, world: int) -> str:
    model = build("branchy")
    for m in (model.left, model.right, model.never):
        m.requires_grad_(False)
    wrapped = BucketDataParallel(model)
    model.right.requires_grad_(True)
    x, y = batch("branchy", 0, rank)
    try:
        # Rank 0 takes the frozen branch, so the unfrozen one has a gradient on rank 1 only.
        F.mse_loss(wrapped(x, use_left=rank == 0), y).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_unfrozen_parameter_unused_on_a_rank_is_named_on_every_rank() -> None:
    for rank, message in enumerate(run_ranks(_unfrozen_but_unused_on_rank0, 2, timeout=60)):
        assert "right.weight" in message and "find_unused_parameters=True" in message, (
            rank,
            message,
        )
