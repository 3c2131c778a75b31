"""Each buffer policy on real gloo process groups, against a ground truth from all ranks.

One launch of three ranks gives every policy (the named ones and two custom functions) a
buffer of per-rank values; the tests check what each rank holds after one and two syncs,
which rule gave each buffer its policy, and how many collectives a sync reports.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from bucketddp import BucketDataParallel
from bucketddp.buffers import policy_label
from multirank import run_ranks

TIMEOUT = 60.0


def product_in_place(buf: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """A custom policy that edits the buffer and returns None."""
    dist.all_reduce(buf, op=dist.ReduceOp.PRODUCT, group=group)


def sum_of_squares(buf: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """A custom policy that returns the new value."""
    out = buf * buf
    dist.all_reduce(out, group=group)
    return out


SEMANTICS_RULES: dict[str, Any] = {
    "f_broadcast": "broadcast",
    "f_mean": "mean",
    "f_sum": "sum",
    "f_max": "max",
    "f_min": "min",
    "f_none": "none",
    "f_inplace": product_in_place,
    "f_returned": sum_of_squares,
    "n_sum": "sum",
    "n_*": "max",  # n_max and n_min, but not n_sum (exact name wins)
    "n_min": "min",
    "flag": "max",
}


class PolicyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        for name in SEMANTICS_RULES:
            if name.startswith("f_"):
                self.register_buffer(name, torch.zeros(2, 3))
        for name in ("n_sum", "n_max", "n_min"):
            self.register_buffer(name, torch.zeros(4, dtype=torch.long))
        self.register_buffer("flag", torch.zeros(3, dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _local_value(rank: int, index: int, buf: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + index)
    if buf.dtype == torch.bool:
        return torch.rand(buf.shape, generator=g) < 0.4
    # Small integers (stored as floats too), so sums and products are exact.
    return torch.randint(-4, 5, buf.shape, generator=g).to(buf.dtype)


def _semantics_worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = PolicyModel()
    ddp = BucketDataParallel(model, buffer_sync=SEMANTICS_RULES)
    local = {}
    with torch.no_grad():
        for i, (name, buf) in enumerate(model.named_buffers()):
            buf.copy_(_local_value(rank, i, buf))
            local[name] = buf.clone()
    first = ddp.sync_buffers()
    once = {n: b.clone() for n, b in model.named_buffers()}
    second = ddp.sync_buffers()
    twice = {n: b.clone() for n, b in model.named_buffers()}
    return {
        "local": local,
        "once": once,
        "twice": twice,
        "counts": (first, second),
        "policies": {n: policy_label(p) for n, p in ddp.buffers_sync.policies.items()},
    }


@pytest.fixture(scope="module")
def semantics() -> list[dict[str, Any]]:
    return run_ranks(_semantics_worker, 3, timeout=TIMEOUT)


def _ground_truth(name: str, policy: str, locals_: list[torch.Tensor], rank: int) -> torch.Tensor:
    stacked = torch.stack(locals_)
    if policy == "broadcast":
        return locals_[0]
    if policy == "mean":
        return stacked.sum(0) / len(locals_)
    if policy == "sum":  # every buffer started at zero, so the total is the ranks' sum
        return stacked.sum(0)
    if policy == "max":
        return stacked.amax(0)
    if policy == "min":
        return stacked.amin(0)
    if policy == "none":
        return locals_[rank]
    if policy.endswith("product_in_place"):
        return stacked.prod(0)
    if policy.endswith("sum_of_squares"):
        return (stacked * stacked).sum(0)
    raise AssertionError(f"no ground truth for {name}: {policy}")


def test_every_buffer_got_the_policy_its_rule_gives(semantics: list[dict[str, Any]]) -> None:
    policies = semantics[0]["policies"]
    assert policies["n_sum"] == "sum"
    assert policies["n_max"] == "max"
    assert policies["n_min"] == "min"
    assert policies["f_inplace"].endswith("product_in_place")
    assert all(r["policies"] == policies for r in semantics)


@pytest.mark.compat("buffers")
def test_each_policy_matches_ground_truth_from_all_ranks(semantics: list[dict[str, Any]]) -> None:
    policies = semantics[0]["policies"]
    for name, policy in policies.items():
        locals_ = [r["local"][name] for r in semantics]
        assert len({tuple(t.flatten().tolist()) for t in locals_}) > 1, f"{name}: ranks agree"
        for rank, result in enumerate(semantics):
            want = _ground_truth(name, policy, locals_, rank)
            got = result["once"][name]
            assert got.dtype == want.dtype or policy == "mean", name
            assert torch.equal(got, want), f"{name} ({policy}) on rank {rank}: {got} != {want}"


def test_reducing_policies_are_idempotent(semantics: list[dict[str, Any]]) -> None:
    policies = semantics[0]["policies"]
    for name, policy in policies.items():
        if policy in ("broadcast", "mean", "max", "min", "sum", "none"):
            for result in semantics:
                assert torch.equal(result["twice"][name], result["once"][name]), name


def _half_means(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = nn.Linear(2, 2)
    model.register_buffer("h", torch.zeros(3, dtype=torch.float16))
    model.register_buffer("b", torch.zeros(3, dtype=torch.bfloat16))
    ddp = BucketDataParallel(model, buffer_sync={"h": "mean", "b": "mean"})
    with torch.no_grad():  # the sums pass each dtype's largest value; the means do not
        model.h.fill_(40000.0 + 20000.0 * rank)
        model.b.fill_(2e38 + 1e38 * rank)
    ddp.sync_buffers()
    return {"h": model.h.clone(), "b": model.b.clone()}


def test_mean_of_half_precision_buffers_does_not_overflow() -> None:
    # Before, the float16 sum overflowed: inf on every rank.
    for result in run_ranks(_half_means, 2, timeout=TIMEOUT):
        assert torch.equal(result["h"], torch.full((3,), 50000.0, dtype=torch.float16))
        assert torch.equal(result["b"], torch.full((3,), 2.5e38, dtype=torch.bfloat16))


def test_sync_reports_one_collective_per_group(semantics: list[dict[str, Any]]) -> None:
    # float: broadcast, mean, sum, max, min; long: sum, max, min; bool: max. The custom
    # functions' own collectives are not counted.
    assert {r["counts"] for r in semantics} == {(9, 9)}
