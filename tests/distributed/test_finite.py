"""check_finite=True: NaN or Inf in a gradient raises on every rank, naming ranks and parameters.

The cases are in tests/support/finite_cases.py. After the error the wrapper trains as torch
DDP does without the bad step; with the check off, it averages NaN as torch DDP does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from engine_cases import TINY
from finite_cases import (
    BAD_PARAMS,
    CONFIGS,
    assert_named_and_recovered,
    poisoned_loss,
    train_configs,
    train_poisoned,
)
from models import build
from multirank import run_ranks


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
        out[label] = train_poisoned(model, wrapped, rank, poison=poison)
    return out


def _unchecked(rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """The gradients of one step with NaN on rank 1, the check off: ours and torch DDP's."""
    out = {}
    for label, wrap in (("ours", lambda m: BucketDataParallel(m, **TINY)), ("ddp", DDP)):
        model = build("mlp")
        wrapped = wrap(model)
        poisoned_loss(model, wrapped, 0, rank, BAD_PARAMS.get(rank, {})).backward()
        out[label] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    return {
        **train_configs(rank, world, list(CONFIGS)),
        "many": _many(rank),
        "off": _unchecked(rank),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """Every case below, run in one pair of processes."""
    return run_ranks(_two_ranks, 2, timeout=90)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_nan_on_rank1_raises_on_every_rank_naming_it_and_training_goes_on(
    two_ranks: list[dict[str, Any]], config: str
) -> None:
    assert_named_and_recovered(two_ranks, config)


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
    return train_poisoned(model, wrapped, rank, poison={0: {"net.4.weight": float("-inf")}})


def test_world_size_1_checks_the_grads() -> None:
    (errors,) = run_ranks(_alone, 1, timeout=60)
    assert len(errors) == 1 and "on rank 0 in ['net.4.weight']" in errors[0], errors
