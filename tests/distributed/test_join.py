"""Uneven inputs: ``BucketDataParallel.join()`` against torch DDP's ``join()``, on gloo."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel, convert_sync_batchnorm
from models import batch, build, train, train_global
from multirank import run_ranks

TINY = {"bucket_cap_mb": 0.002, "first_bucket_mb": 0.0005}


def _left_on_even_steps(rank: int, step: int) -> bool:
    return (rank + step) % 2 == 0


CASES: dict[str, dict[str, Any]] = {
    "mlp": {"name": "mlp", "steps": [3, 5]},
    "divide_by_remaining": {
        "name": "mlp",
        "steps": [3, 5],
        "join": {"divide_by_initial_world_size": False},
    },
    "conv_bn_buffers": {"name": "conv", "steps": [4, 2]},
    "three_ranks": {"name": "mlp", "steps": [2, 5, 3]},
    "three_ranks_by_remaining": {
        "name": "conv",
        "steps": [4, 1, 3],
        "join": {"divide_by_initial_world_size": False},
    },
    "tiny_buckets": {"name": "mlp", "steps": [2, 4], "ours": TINY},
    "no_batches_on_one_rank": {"name": "mlp", "steps": [0, 3]},
    # torch DDP is no ground truth here: a joined rank adds the used-parameter counts of
    # its last step to every later step, so a branch no training rank takes still gets a
    # zero gradient there (and a momentum update). One process on the global batch gets none.
    "find_unused": {
        "name": "branchy",
        "steps": [3, 5],
        "ours": {"find_unused_parameters": True},
        "train": {"branch": _left_on_even_steps},
        "truth": "global",
    },
    "no_sync_accumulation": {"name": "mlp", "steps": [2, 3], "train": {"accumulate": 2}},
    "grads_kept": {"name": "tied", "steps": [4, 2], "train": {"set_to_none": False}},
    "comm_hook": {"name": "mlp", "steps": [3, 5], "hook": "allreduce"},
    # PowerSGD's agreement row goes on a private group: the joined rank's must match it.
    # (One bucket: torch DDP's joined rank calls the hook of each bucket without waiting.)
    "comm_hook_powersgd": {"name": "mlp", "steps": [3, 6], "hook": "powersgd"},
    "world_size_1": {"name": "mlp", "steps": [3]},
}


def _hooked(wrapper: Any, hook: str | None, **opts: Any) -> Any:
    def wrap(model: nn.Module) -> nn.Module:
        wrapped = wrapper(model, **opts)
        if hook == "allreduce":
            wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
        elif hook == "powersgd":  # compressing from the third step, rank 1
            state = powerSGD_hook.PowerSGDState(
                None, matrix_approximation_rank=1, start_powerSGD_iter=2
            )
            wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return wrapped

    return wrap


def _uneven(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train through our join, and through torch DDP's unless the truth is the global batch."""
    name, steps, hook = case["name"], case["steps"], case.get("hook")
    join, kw = case.get("join", {}), case.get("train", {})
    out = {}
    systems = {"ours": _hooked(BucketDataParallel, hook, **case.get("ours", {}))}
    if case.get("truth", "ddp") == "ddp":
        systems["ddp"] = _hooked(DDP, hook)
    for system, wrap in systems.items():
        result = train(name, wrap, rank, steps=steps, join=join, **kw)
        out[system] = {**result["params"], **result["buffers"]}
    return out


def _global_batch(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    by_initial = case.get("join", {}).get("divide_by_initial_world_size", True)
    branch = case.get("train", {}).get("branch")
    return train_global(case["name"], case["steps"], by_initial=by_initial, branch=branch)


@pytest.mark.parametrize("case", list(CASES))
def test_uneven_inputs_give_the_weights_of_torch_ddp_join(case: str) -> None:
    spec = CASES[case]
    if spec.get("hook") == "powersgd" and torch.cuda.is_available():
        pytest.skip("torch's powerSGD_hook fails on CPU tensors where CUDA is available")
    results = run_ranks(_uneven, len(spec["steps"]), spec, timeout=90)
    reference = _global_batch(spec) if spec.get("truth") == "global" else None
    for rank, r in enumerate(results):
        truth = reference if reference is not None else r["ddp"]
        assert r["ours"].keys() >= truth.keys()
        for n, want in truth.items():
            torch.testing.assert_close(
                r["ours"][n], want, rtol=0, atol=1e-6, msg=f"{n} on rank {rank}"
            )
    # Every rank ends with the same model: the last joiner's.
    for n, want in results[0]["ours"].items():
        for rank, r in enumerate(results[1:], start=1):
            assert torch.equal(r["ours"][n], want), f"{n} differs on rank {rank}"


def _error_of(
    rank: int,
    world: int,
    wrapper: Any,
    join: dict[str, Any],
    steps: list[int],
    around: Callable[[Any, int, int], AbstractContextManager[Any]],
) -> str:
    """Train the MLP inside ``join(**join)``; the RuntimeError this rank raised, if any."""
    model = wrapper(build("mlp"))
    try:
        with model.join(**join):
            for step in range(steps[rank]):
                x, y = batch("mlp", step, rank)
                with around(model, rank, step):
                    F.mse_loss(model(x), y).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _plain(model: Any, rank: int, step: int) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


def _rank1_accumulates_step1(model: Any, rank: int, step: int) -> AbstractContextManager[Any]:
    # Rank 1 accumulates its second step while rank 0 syncs it: a user bug.
    return model.no_sync() if (rank, step) == (1, 1) else contextlib.nullcontext()


def _rank1_freezes_at_step2(model: Any, rank: int, step: int) -> AbstractContextManager[Any]:
    if step == 2:  # only rank 1 is still training
        model.module.net[0].weight.requires_grad_(False)
    return contextlib.nullcontext()


def test_throw_on_early_termination_raises_on_every_rank_as_torch_ddp() -> None:
    args = ({"throw_on_early_termination": True}, [2, 4], _plain)
    ours = run_ranks(_error_of, 2, BucketDataParallel, *args, timeout=60)
    theirs = run_ranks(_error_of, 2, DDP, *args, timeout=60)
    assert ours == theirs
    assert "exhausted all inputs" in ours[0]
    assert "Detected at least one rank that exhausted inputs" in ours[1]


class Counters(nn.Module):
    """Each forward adds 1 to three buffers synced by "sum", "mean" and "min"."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 4)
        for b in ("total", "avg", "low"):
            self.register_buffer(b, torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in (self.total, self.avg, self.low):
            b.add_(1)
        return self.lin(x)


def _policies(rank: int, world: int, steps: list[int]) -> dict[str, float]:
    torch.manual_seed(0)
    model = BucketDataParallel(
        Counters(), buffer_sync={"total": "sum", "avg": "mean", "low": "min"}
    )
    with model.join():
        for step in range(steps[rank]):
            x, y = batch("mlp", step, rank)
            F.mse_loss(model(x), y).backward()
    seen = {b: float(getattr(model.module, b)) for b in ("avg", "low")}
    model.sync_buffers()  # outside join: every rank's pending additions arrive
    seen["total"] = float(model.module.total)
    return seen


def test_reducing_buffer_policies_leave_out_joined_ranks() -> None:
    steps = [2, 5, 3]
    results = run_ranks(_policies, 3, steps, timeout=60)
    longest = max(steps)
    for rank, r in enumerate(results):
        # "sum" counts every forward of every rank, each once.
        assert r["total"] == sum(steps), rank
        # "mean" and "min" follow the ranks still training: +1 per iteration. A joined
        # rank's stale value would drag both below that.
        expect = longest if steps[rank] == longest else longest - 1
        assert r["avg"] == expect, (rank, r)
        assert r["low"] == expect, (rank, r)


def _syncbn(rank: int, world: int) -> str:
    model = BucketDataParallel(convert_sync_batchnorm(build("conv")))
    try:
        model.join()
    except ValueError as e:
        return str(e)
    return "no error"


def test_join_refuses_syncbatchnorm_on_every_rank() -> None:
    for said in run_ranks(_syncbn, 2, timeout=60):
        assert "SyncBatchNorm layers ['features.1']" in said
        assert "drop_last=True" in said


def test_ranks_that_disagree_on_syncing_raise_instead_of_hanging() -> None:
    args = (BucketDataParallel, {}, [3, 4], _rank1_accumulates_step1)
    for said in run_ranks(_error_of, 2, *args, timeout=60):
        assert "1 of the 2 ranks still training sync the backward" in said


def _with_validation(rank: int, world: int, steps: list[int]) -> dict[str, torch.Tensor]:
    model = build("mlp")
    wrapped = BucketDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with wrapped.join():
        for step in range(steps[rank]):
            x, y = batch("mlp", step, rank)
            F.mse_loss(wrapped(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():  # a validation forward: no backward follows
                wrapped(x)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_no_grad_forwards_inside_join_need_no_backward() -> None:
    steps = [2, 4]
    reference = train_global("mlp", steps)
    for rank, params in enumerate(run_ranks(_with_validation, 2, steps, timeout=60)):
        for n, want in reference.items():
            torch.testing.assert_close(params[n], want, rtol=0, atol=1e-6, msg=f"{n} {rank}")


def test_requires_grad_change_while_a_rank_has_finished_raises_on_every_rank() -> None:
    args = (BucketDataParallel, {}, [1, 3], _rank1_freezes_at_step2)
    for said in run_ranks(_error_of, 2, *args, timeout=60):
        assert "requires_grad differs between ranks for parameters net.0.weight" in said


def _switch(model: nn.Module, change: str, step: int) -> None:
    """``unfreeze``: net.0.weight frozen until after step 1. ``freeze``: net.0.bias from then."""
    if change == "unfreeze":
        model.net[0].weight.requires_grad_(step > 1)
    else:
        model.net[0].bias.requires_grad_(step <= 1)


def _switching(
    rank: int, world: int, steps: list[int], by_initial: bool, change: str
) -> dict[str, Any]:
    """The MLP with a parameter (un)frozen on every rank after that rank's step 1."""
    model = build("mlp")
    _switch(model, change, 0)
    wrapped = BucketDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with wrapped.join(divide_by_initial_world_size=by_initial):
        for step in range(steps[rank]):
            x, y = batch("mlp", step, rank)
            F.mse_loss(wrapped(x), y).backward()
            opt.step()
            opt.zero_grad()
            _switch(model, change, step + 1)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("by_initial", [True, False])
@pytest.mark.parametrize("change", ["unfreeze", "freeze"])
def test_a_parameter_switched_on_every_rank_after_one_joined_trains_as_one_process(
    by_initial: bool, change: str
) -> None:
    # Rank 1 switches the parameter after its last step, then joins; rank 0's next backward
    # is the first to see the change on every rank. Before, with "unfreeze", the joined rank
    # missed the extra all-reduce of parameters now trainable everywhere: gloo failed with a
    # collective mismatch. With "freeze", the frozen parameter got a zero .grad on rank 0
    # (the joined rank sent no "missing" flag for it), and momentum moved it on.
    steps = [4, 2]
    truth = build("mlp")
    _switch(truth, change, 0)
    opt = torch.optim.SGD(truth.parameters(), lr=0.05, momentum=0.9)
    for step in range(max(steps)):
        training = [r for r in range(2) if steps[r] > step]
        for r in training:
            x, y = batch("mlp", step, r)
            (F.mse_loss(truth(x), y) / (2 if by_initial else len(training))).backward()
        opt.step()
        opt.zero_grad()
        _switch(truth, change, step + 1)
    results = run_ranks(_switching, 2, steps, by_initial, change, timeout=60)
    for n, want in truth.named_parameters():
        torch.testing.assert_close(results[0][n], want.detach(), rtol=0, atol=1e-6, msg=n)


def _with_zero(rank: int, world: int, wrapper: Any, steps: list[int]) -> dict[str, torch.Tensor]:
    model = build("mlp")
    wrapped = wrapper(model)
    opt = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9
    )
    with Join([wrapped, opt]):  # two joinables: the optimizer shadows its own step
        for step in range(steps[rank]):
            x, y = batch("mlp", step, rank)
            F.mse_loss(wrapped(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_join_beside_zero_redundancy_optimizer_matches_torch_ddp() -> None:
    ours = run_ranks(_with_zero, 2, BucketDataParallel, [3, 5], timeout=60)
    theirs = run_ranks(_with_zero, 2, DDP, [3, 5], timeout=60)
    for rank, (mine, want) in enumerate(zip(ours, theirs, strict=True)):
        for n in want:
            torch.testing.assert_close(mine[n], want[n], rtol=0, atol=1e-6, msg=f"{n} {rank}")
