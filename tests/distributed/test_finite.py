"""check_finite=True: NaN or Inf in a gradient raises on every rank, naming ranks and parameters.

The ground truth after an error is torch DDP on the same batches with the bad step skipped:
the user catches the error, zeroes the gradients and goes on, and the wrapper must train
as if that step had never run. With the check off, bucketddp averages NaN as torch DDP does.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from engine_cases import TINY
from models import assert_weights, batch, build
from multirank import run_ranks

STEPS, BAD = 4, 2  # the step whose gradients are poisoned
BAD_PARAMS = {1: {"net.2.weight": float("nan")}}  # by rank: parameter -> poison

CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "comm_hook": {"hook": default_hooks.allreduce_hook},
    "no_sync": {"accumulate": 2},  # poisoned in the first micro-batch, inside no_sync()
    "unused": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "copies": {"gradient_as_bucket_view": False},
    "fused": {"fused": True},  # the accelerators' way: one norm kernel per bucket
}


def _loss(
    model: nn.Module, wrapped: nn.Module, step: int, rank: int, poison: dict[str, float]
) -> torch.Tensor:
    x, y = (t.to(next(model.parameters()).device) for t in batch("mlp", step, rank))
    loss = F.mse_loss(wrapped(x), y)
    params = dict(model.named_parameters())
    # An added p.sum() * nan gives p (and no other parameter) a NaN gradient.
    return sum((params[n].sum() * v for n, v in poison.items()), loss)


def _train(
    model: nn.Module,
    wrapped: nn.Module,
    rank: int,
    *,
    accumulate: int = 1,
    poison: dict[int, dict[str, float]] | None = None,
) -> list[str]:
    """STEPS steps; at BAD, rank r's gradients get ``poison[r]``, or the step is skipped
    (``poison`` None). Returns the errors caught, the step skipped after each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    errors = []
    for step in range(STEPS):
        if step == BAD and poison is None:
            continue
        mine = poison.get(rank, {}) if poison is not None and step == BAD else {}
        try:
            for micro in range(accumulate):
                last = micro == accumulate - 1
                with contextlib.nullcontext() if last else wrapped.no_sync():  # type: ignore[operator]
                    dose = mine if micro == 0 else {}
                    _loss(model, wrapped, step * accumulate + micro, rank, dose).backward()
        except RuntimeError as e:
            errors.append(str(e))
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    return errors


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _configs(rank: int, world: int, names: list[str], device: str = "cpu") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for accumulate in sorted({CONFIGS[n].get("accumulate", 1) for n in names}):
        model = build("mlp").to(device)
        _train(model, DDP(model), rank, accumulate=accumulate)
        out[f"ddp/{accumulate}"] = _params(model)
    from bucketddp.reducer import finite

    for name in names:
        opts = dict(CONFIGS[name])
        hook, accumulate = opts.pop("hook", None), opts.pop("accumulate", 1)
        finite.LOOPED = frozenset() if opts.pop("fused", False) else frozenset({"cpu"})
        model = build("mlp").to(device)
        wrapped = BucketDataParallel(model, check_finite=True, **TINY, **opts)
        if hook is not None:
            wrapped.register_comm_hook(None, hook)
        errors = _train(model, wrapped, rank, accumulate=accumulate, poison=BAD_PARAMS)
        out[name] = {"errors": errors, "params": _params(model), "accumulate": accumulate}
    return out


def _many(rank: int) -> dict[str, list[str]]:
    """Inf on rank 0, NaN in four parameters on rank 1: in float32, and in digits."""
    from bucketddp.reducer import finite

    poison = {
        0: {"net.0.bias": float("inf")},
        1: {n: float("nan") for n in ("net.4.bias", "net.2.bias", "net.0.weight", "net.4.weight")},
    }
    out = {}
    # Digits of base 4 stand for bfloat16's base 256 (and its models of 256+ parameters).
    for label in ("float32", "digits"):
        if label == "digits":
            finite.exact_base = lambda dtype: 4  # type: ignore[assignment]
        model = build("mlp")
        wrapped = BucketDataParallel(model, check_finite=True, **TINY)
        out[label] = _train(model, wrapped, rank, poison=poison)
    return out


def _unchecked(rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """The gradients of one step with NaN on rank 1, the check off: ours and torch DDP's."""
    out = {}
    for label, wrap in (("ours", lambda m: BucketDataParallel(m, **TINY)), ("ddp", DDP)):
        model = build("mlp")
        wrapped = wrap(model)
        _loss(model, wrapped, 0, rank, BAD_PARAMS.get(rank, {})).backward()
        out[label] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    return {**_configs(rank, world, list(CONFIGS)), "many": _many(rank), "off": _unchecked(rank)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """Every case below, run in one pair of processes."""
    return run_ranks(_two_ranks, 2, timeout=90)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_nan_on_rank1_raises_on_every_rank_naming_it_and_training_goes_on(
    two_ranks: list[dict[str, Any]], config: str
) -> None:
    for rank, r in enumerate(two_ranks):
        got = r[config]
        assert len(got["errors"]) == 1, got["errors"]
        message = got["errors"][0]
        assert "on rank 1 in ['net.2.weight'] (check_finite=True)" in message, message
        assert "rank 0" not in message
        # The steps after the error train as torch DDP does without the bad step.
        assert_weights(got["params"], r[f"ddp/{got['accumulate']}"], rank)


def test_inf_and_nan_on_both_ranks_are_named_by_rank(two_ranks: list[dict[str, Any]]) -> None:
    want = (
        "on rank 0 in ['net.0.bias']; rank 1 in ['net.0.weight', 'net.2.bias', 'net.4.weight'] "
        "and 1 more (check_finite=True)"
    )
    for r in two_ranks:
        for errors in r["many"].values():
            assert len(errors) == 1 and want in errors[0], errors


def test_with_the_check_off_nan_is_averaged_as_torch_ddp_does(
    two_ranks: list[dict[str, Any]],
) -> None:
    for r in two_ranks:
        ours, theirs = r["off"]["ours"], r["off"]["ddp"]
        assert ours["net.2.weight"].isnan().all()
        for name, grad in theirs.items():
            torch.testing.assert_close(ours[name], grad, equal_nan=True, msg=name)


def _alone(rank: int, world: int) -> list[str]:
    model = build("mlp")
    wrapped = BucketDataParallel(model, check_finite=True)
    return _train(model, wrapped, rank, poison={0: {"net.4.weight": float("-inf")}})


def test_world_size_1_checks_the_grads() -> None:
    (errors,) = run_ranks(_alone, 1, timeout=30)
    assert len(errors) == 1 and "on rank 0 in ['net.4.weight']" in errors[0], errors
