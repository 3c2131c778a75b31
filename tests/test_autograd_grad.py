"""torch.autograd.grad inside a training step (gradient penalties), against torch DDP on gloo.

``torch.autograd.grad`` accumulates nothing into ``.grad``, so it must not end a step:
before, the wrapper took it for a backward pass in which no parameter got a gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from models import assert_weights, batch, build
from multirank import run_ranks

STEPS = 3


def _penalized_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, wrt: str) -> torch.Tensor:
    """MSE plus a gradient penalty: the squared gradient of the output w.r.t. ``wrt``."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = [x] if wrt == "input" else params
    grads = torch.autograd.grad(out.sum(), inputs, create_graph=True)
    return F.mse_loss(out, y) + 0.1 * sum(g.pow(2).sum() for g in grads)


def _train(rank: int, wrap: Callable[[nn.Module], nn.Module], wrt: str, accumulate: int) -> Any:
    net = build("mlp")
    model = wrap(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    untouched = True
    for step in range(STEPS):
        for micro in range(accumulate):
            last = micro == accumulate - 1
            with contextlib.nullcontext() if last else model.no_sync():  # type: ignore[operator]
                x, y = batch("mlp", step * accumulate + micro, rank)
                before = _grads(net)
                loss = _penalized_loss(model, x, y, wrt)
                # autograd.grad reduced nothing: the local gradients so far are as they were.
                untouched &= all(
                    (a is None and b is None) or (a is not None and b is not None and a.equal(b))
                    for a, b in zip(before, _grads(net), strict=True)
                )
                loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}, untouched


def _grads(net: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in net.parameters()]


def _global(world: int, wrt: str, accumulate: int) -> dict[str, torch.Tensor]:
    """One process: each step on the global batch, the per-rank losses averaged."""
    net = build("mlp")
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        for micro in range(accumulate):
            for r in range(world):
                x, y = batch("mlp", step * accumulate + micro, r)
                (_penalized_loss(net, x, y, wrt) / world).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


CASES: dict[str, dict[str, Any]] = {
    "input_penalty": {"wrt": "input"},
    "parameter_penalty": {"wrt": "params"},
    "input_penalty_unused_allowed": {"wrt": "input", "opts": {"find_unused_parameters": True}},
    "input_penalty_tiny_buckets": {
        "wrt": "input",
        "opts": {"bucket_cap_mb": 0.002},
        "ours": {"first_bucket_mb": 0.0005},
    },
    "input_penalty_no_sync": {"wrt": "input", "accumulate": 2},
}


def _both(rank: int, world: int, case: dict[str, Any]) -> tuple[Any, Any]:
    opts, wrt, acc = case.get("opts", {}), case["wrt"], case.get("accumulate", 1)
    ours_opts = {**opts, **case.get("ours", {})}
    ours = _train(rank, lambda m: BucketDataParallel(m, **ours_opts), wrt, acc)
    theirs = _train(rank, lambda m: DDP(m, **opts), wrt, acc)
    return ours, theirs


@pytest.mark.parametrize("case", CASES)
def test_gradient_penalty_gives_the_weights_of_torch_ddp_and_the_global_batch(case: str) -> None:
    spec = CASES[case]
    want = _global(2, spec["wrt"], spec.get("accumulate", 1))
    for rank, ((ours, untouched), (theirs, _)) in enumerate(run_ranks(_both, 2, spec, timeout=90)):
        assert_weights(ours, theirs, rank)
        assert_weights(ours, want, rank)
        assert untouched, f"torch.autograd.grad changed .grad on rank {rank}"
