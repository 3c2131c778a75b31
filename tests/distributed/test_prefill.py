"""Gradients accumulated straight into their buckets (``reducer/prefill.py``).

With ``gradient_as_bucket_view`` (the default), each step's gradients after the first go
into their slots in the backward itself, with nothing copied: the weights stay those of
torch DDP, with and without a comm hook, and a frozen parameter's ``.grad`` stays None.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from multirank import run_ranks

STEPS = 3


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    hidden = [torch.nn.Linear(16, 16) for _ in range(10)]  # many small parameters
    frozen = torch.nn.Linear(16, 16).requires_grad_(False)  # its .grad stays None
    return torch.nn.Sequential(torch.nn.Linear(6, 16), *hidden, frozen, torch.nn.Linear(16, 3))


def _train(rank: int, world: int, hook: bool, view: bool) -> dict[str, Any]:
    nets = {"ours": _net(), "torch": _net()}
    wrapped: list[BucketDataParallel] = []
    in_place: list[int] = []

    def count(p: torch.Tensor) -> None:
        # Whether autograd accumulated this gradient in bucket memory. Registered before
        # wrapping, this hook runs before the wrapper's.
        assert p.grad is not None
        ptr = p.grad.data_ptr()
        storages = [b.storage for b in wrapped[0].reducer.buckets]
        in_place[-1] += any(s.data_ptr() <= ptr < s.data_ptr() + s.nbytes for s in storages)

    trainable = [p for p in nets["ours"].parameters() if p.requires_grad]
    for p in trainable:
        p.register_post_accumulate_grad_hook(count)
    ours = BucketDataParallel(nets["ours"], gradient_as_bucket_view=view)
    theirs = DDP(nets["torch"])
    if hook:
        for model in (ours, theirs):
            model.register_comm_hook(None, default_hooks.allreduce_hook)
    wrapped.append(ours)
    opts = {k: torch.optim.SGD(n.parameters(), lr=0.1, momentum=0.9) for k, n in nets.items()}
    for step in range(STEPS):
        in_place.append(0)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        for name, model in (("ours", ours), ("torch", theirs)):
            model(x).square().sum().backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
    frozen_grad = nets["ours"][11].weight.grad
    weights = {k: [p.detach().clone() for p in n.parameters()] for k, n in nets.items()}
    return {"in_place": in_place, "trainable": len(trainable), "frozen": frozen_grad, **weights}


@pytest.mark.parametrize("hook", [False, True], ids=["no_hook", "allreduce_hook"])
def test_gradients_go_straight_into_their_buckets_with_torch_ddps_weights(hook: bool) -> None:
    for r in run_ranks(_train, 2, hook, True):
        # Every gradient of a step but its first (copied, before the others are placed).
        assert r["in_place"] == [r["trainable"] - 1] * STEPS, r["in_place"]
        assert r["frozen"] is None
        for ours, theirs in zip(r["ours"], r["torch"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_without_bucket_views_each_gradient_keeps_its_own_tensor() -> None:
    for r in run_ranks(_train, 2, False, False):
        assert r["in_place"] == [0] * STEPS
        for ours, theirs in zip(r["ours"], r["torch"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
