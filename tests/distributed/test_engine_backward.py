"""The backward pass when it goes wrong, on real gloo process groups.

A parameter that gets no gradient raises in that backward on every rank, naming it, with
its flags in one row or several; backward(create_graph=True) is refused by name; and
training recovers after a backward that raised halfway.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bucketddp import BucketDataParallel
from engine_cases import CASES, TINY, assert_same_as_ddp, train_both
from models import assert_weights, batch, build, split_flags, train_global
from multirank import raised, run_ranks


def _unused_error(rank: int, world: int) -> str:
    model = build("branchy")
    ddp = BucketDataParallel(model, **TINY)
    x, y = batch("branchy", 0, rank)
    try:
        # Rank 1 takes the other branch, so "left" gets no gradient there.
        F.mse_loss(ddp(x, use_left=rank == 0), y).backward()
    except RuntimeError as e:
        message = str(e)
    else:
        message = ""
    # The reducer must be usable again after the error: a clean step goes through.
    ddp_ok = BucketDataParallel(build("mlp"))
    xm, ym = batch("mlp", 0, rank)
    F.mse_loss(ddp_ok(xm), ym).backward()
    return message


def test_unused_parameter_error_is_raised_in_that_backward_on_every_rank() -> None:
    # Raised by the backward itself, not by a collective that timed out: the process group
    # times out with run_ranks (60 s), and its error would name no parameter.
    for message in run_ranks(_unused_error, 2, timeout=60):
        assert "find_unused_parameters=True" in message
        assert "'left.weight'" in message and "'never.weight'" in message


def _create_graph(rank: int, world: int, view: bool) -> tuple[str, dict[str, torch.Tensor]]:
    """backward(create_graph=True) raises; the steps after it train as usual."""
    model = build("mlp")
    wrapped = BucketDataParallel(model, gradient_as_bucket_view=view)
    x, y = batch("mlp", 0, rank)
    message = raised(lambda: F.mse_loss(wrapped(x), y).backward(create_graph=True))
    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(2):
        x, y = batch("mlp", step, rank)
        F.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
    return message, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("view", [True, False])
def test_create_graph_is_refused_by_name_on_every_rank(view: bool) -> None:
    # torch DDP fails here too, with autograd's "a leaf Variable that requires grad is being
    # used in an in-place operation"; before, ours failed with "mul(): functions with out=...
    # arguments don't support automatic differentiation".
    want = train_global("mlp", [2, 2])
    for rank, (message, params) in enumerate(run_ranks(_create_graph, 2, view, timeout=60)):
        assert "has a gradient that requires grad: backward(create_graph=True)" in message
        assert "torch.autograd.grad(" in message
        assert_weights(params, want, rank)


def _rows_forced(rank: int, world: int, case: str) -> Any:
    # Each rank writes its flags in row rank % rows, added up in float64 after the sum.
    split_flags(lambda world_size: min(2, world_size))
    if case == "unused_error":
        return _unused_error(rank, world)
    return train_both(rank, world, *CASES[case])


@pytest.mark.parametrize(("case", "world"), [("unused_by_rank", 3), ("frozen", 2)])
def test_flags_in_several_rows_give_the_weights_of_torch_ddp(case: str, world: int) -> None:
    assert_same_as_ddp(run_ranks(_rows_forced, world, case))


def test_flags_in_several_rows_still_name_unused_parameters() -> None:
    for message in run_ranks(_rows_forced, 2, "unused_error", timeout=60):
        assert "'left.weight'" in message and "'never.weight'" in message


class _FailOnce(torch.autograd.Function):
    """Identity in forward; raises in backward the first time, on every rank."""

    armed = True

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise ValueError("boom")
        return g


def _recover_after_failed_backward(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = build("mlp")
    ddp = BucketDataParallel(model, **TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x, y = batch("mlp", step, rank)
        if step == 0:
            # A backward that raises halfway, on every rank: the head's hooks have fired
            # and its bucket is in flight, the first layer's gradients never come.
            net = ddp.module.net
            _FailOnce.armed = True
            with pytest.raises(ValueError, match="boom"):
                F.mse_loss(net[2:](_FailOnce.apply(net[:2](x))), y).backward()
            opt.zero_grad()
            continue
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_training_recovers_after_a_failed_backward() -> None:
    # torch DDP refuses to go on after an unfinished reduction, so the ground truth is one
    # process on the global batch, with the failed step skipped.
    model = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in (1, 2):
        xs, ys = zip(*(batch("mlp", step, r) for r in range(2)), strict=True)
        F.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    for r in run_ranks(_recover_after_failed_backward, 2):
        for n, p in model.named_parameters():
            assert torch.allclose(r[n], p.detach(), atol=1e-6, rtol=0), n
