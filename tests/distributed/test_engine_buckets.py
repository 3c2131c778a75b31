"""Gradient buckets on real gloo process groups: views, layouts, plan, collectives, sizes.

Gradients are views into the buckets and keep their parameters' strides; the ranks agree on
rank 0's bucket order; each step reduces one collective per bucket; torch DDP's bucket
sizes are accepted; and gradients kept past the next backward stay intact.
"""

from __future__ import annotations

import itertools
import warnings
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from engine_cases import TINY, assert_same_as_ddp, train_both
from models import batch, build, train
from multirank import RankError, run_ranks


def _views_and_plan(rank: int, world: int, set_to_none: bool) -> dict[str, Any]:
    model = build("mixed")
    ddp = BucketDataParallel(model, **TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    storages = []
    for step in range(3):
        x, y = batch("mixed", step, rank)
        F.mse_loss(ddp(x), y).backward()
        # After the first step the plan is rebuilt; the views must follow the new storage.
        storages.append(
            {
                n: p.grad.untyped_storage().data_ptr()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        )
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    reducer = ddp.reducer
    bucket_ptrs = {b.storage.untyped_storage().data_ptr() for b in reducer.buckets}
    plan = ddp.bucket_plan
    return {
        "last": storages[-1],
        "bucket_ptrs": bucket_ptrs,
        "n_params": sum(1 for p in model.parameters()),
        "plan": [(b.names, b.numel, b.nbytes, b.dtype) for b in plan],
        "learned": plan.learned,
    }


@pytest.mark.parametrize("set_to_none", [True, False])
def test_grads_are_bucket_views(set_to_none: bool) -> None:
    for r in run_ranks(_views_and_plan, 2, set_to_none):
        assert len(r["last"]) == r["n_params"]
        assert set(r["last"].values()) <= r["bucket_ptrs"]
        assert r["learned"]
        for names, numel, nbytes, dtype in r["plan"]:
            assert names and numel > 0
            assert nbytes == numel * torch.empty((), dtype=dtype).element_size()
        # Buckets never mix dtypes: float64 params sit in float64 buckets only.
        dtypes = {n: dt for names, _, _, dt in r["plan"] for n in names}
        assert all(dt == torch.float64 for n, dt in dtypes.items() if n.startswith("b."))
        assert all(dt == torch.float32 for n, dt in dtypes.items() if not n.startswith("b."))


def _layouts(rank: int, world: int) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = train("channels_last", BucketDataParallel, rank, set_to_none=False)
    model = out["wrapped"].module
    return {
        "warnings": [str(w.message) for w in caught if "layout contract" in str(w.message)],
        "strides_match": all(p.grad.stride() == p.stride() for p in model.parameters()),
        "views": all(
            p.grad.data_ptr() == v.data_ptr()
            for p, v in zip(model.parameters(), out["wrapped"].reducer.views, strict=True)
        ),
    }


def test_bucket_views_keep_the_parameters_layout() -> None:
    # channels_last conv weights: each gradient view takes its parameter's strides, as
    # torch DDP's bucket views do, so AccumulateGrad sees the layout it expects.
    for r in run_ranks(_layouts, 2, timeout=60):
        assert r["warnings"] == []
        assert r["strides_match"] and r["views"]


def _count_collectives(rank: int, world: int) -> dict[str, Any]:
    model = build("mlp")
    ddp = BucketDataParallel(model, **TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = []
    for step in range(4):
        x, y = batch("mlp", step, rank)
        with torch.profiler.profile() as prof:
            F.mse_loss(ddp(x), y).backward()
        counts.append(sum(1 for e in prof.events() if e.name.startswith("c10d::")))
        opt.step()
        opt.zero_grad()
    return {"counts": counts, "buckets": len(ddp.bucket_plan), "stats": ddp.comm_stats}


def test_one_collective_per_bucket_per_step() -> None:
    for r in run_ranks(_count_collectives, 2):
        assert r["buckets"] >= 3
        # Step 0 also broadcasts rank 0's learned order once; steps after it reduce only.
        assert r["counts"][1:] == [r["buckets"]] * 3
        assert r["stats"].collectives == r["buckets"]
        assert r["stats"].bytes_reduced > 0
        assert r["stats"].wait_seconds >= 0


def _plans_agree_despite_different_orders(rank: int, world: int) -> list[tuple[str, ...]]:
    model = build("branchy")
    ddp = BucketDataParallel(model, find_unused_parameters=True, **TINY)
    x, y = batch("branchy", 0, rank)
    F.mse_loss(ddp(x, use_left=rank == 0), y).backward()
    return [b.names for b in ddp.bucket_plan]


def test_rank0_order_wins_when_ranks_observe_different_orders() -> None:
    plans = run_ranks(_plans_agree_despite_different_orders, 2)
    assert plans[0] == plans[1]
    # Rank 0 used "left": its order puts left's gradients before right's (unused there).
    order = [n for names in plans[0] for n in names]
    assert order.index("left.weight") < order.index("right.weight")


def test_bad_bucket_size_is_rejected() -> None:
    with pytest.raises(RankError, match="bucket_cap_mb"):
        run_ranks(_bad_cap, 2, timeout=60)


@pytest.mark.parametrize(
    ("caps", "per_bucket"),
    [
        # torch DDP's own default value: 25 MB, one bucket for the whole small MLP here.
        ({"bucket_cap_mb": None, "first_bucket_mb": 25.0}, None),
        # Below one gradient's size, as torch DDP accepts: a bucket per parameter.
        ({"bucket_cap_mb": 1e-7, "first_bucket_mb": 1e-7}, 1),
    ],
)
def test_torch_ddp_bucket_sizes_are_accepted(caps: dict[str, Any], per_bucket: int | None) -> None:
    results = run_ranks(train_both, 2, "mlp", caps, {})
    assert_same_as_ddp(results)
    plan = results[0]["plan"]
    if per_bucket is None:
        assert len(plan) == 1
    else:
        assert len(plan) > 1 and all(len(names) == per_bucket for names in plan)


def _bad_cap(rank: int, world: int) -> None:
    BucketDataParallel(torch.nn.Linear(2, 2), bucket_cap_mb=0)


def _kept_gradients(rank: int, world: int) -> dict[str, Any]:
    """Two losses, the first one's gradients kept across zero_grad (PCGrad-style)."""
    out = {}
    for name, wrap, keep in (
        ("torch", DDP, None),
        ("views", BucketDataParallel, None),
        ("views, detached", BucketDataParallel, torch.Tensor.detach),
        ("copies", partial(BucketDataParallel, gradient_as_bucket_view=False), None),
    ):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        ddp = wrap(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        kept_intact = []
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(3, 4, generator=g)
            ddp(x).pow(2).sum().backward()
            first = [p.grad if keep is None else keep(p.grad) for p in model.parameters()]
            copies = [f.clone() for f in first]
            opt.zero_grad(set_to_none=True)
            ddp(x).sum().backward()
            kept_intact.append(all(torch.equal(f, c) for f, c in zip(first, copies, strict=True)))
            for p, f in zip(model.parameters(), first, strict=True):
                p.grad = p.grad + f
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = (kept_intact, [p.detach().clone() for p in model.parameters()])
    # A tensor taken on a gradient during the backward (a hook registered after wrapping)
    # shares the reduced gradient, as with torch DDP: the bucket does not move under it.
    for name, wrap in (("torch", DDP), ("views", BucketDataParallel)):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        ddp = wrap(model)
        taken: list[torch.Tensor] = []
        last = model[1].weight  # ready early in the backward; the first layer's come later
        last.register_post_accumulate_grad_hook(
            lambda p, taken=taken: taken.append(p.grad.detach())
        )
        for _ in range(2):
            ddp(torch.randn(3, 4)).sum().backward()
            model.zero_grad(set_to_none=True)
        ddp(torch.randn(3, 4)).sum().backward()
        out[f"{name} in backward"] = taken[-1].data_ptr() == last.grad.data_ptr()
    # A bucket moved once for a tensor kept on its memory stays put once nothing is kept.
    model = torch.nn.Linear(4, 2)
    ddp = BucketDataParallel(model)
    kept: torch.Tensor | None = None
    storage_ptrs = []
    for step in range(4):
        ddp(torch.randn(3, 4)).sum().backward()
        kept = model.weight.grad.detach() if step == 0 else None
        model.zero_grad(set_to_none=True)
        storage_ptrs.append(ddp.reducer.buckets[-1].storage.data_ptr())
    out["moves"] = [a != b for a, b in itertools.pairwise(storage_ptrs)]
    del kept
    return out


def test_gradients_kept_past_the_next_backward_stay_intact_as_with_torch_ddp() -> None:
    # Before, with bucket views, the next backward wrote into the kept .grad (the weights
    # ended 0.059 from torch DDP's in a Lightning PCGrad-style module).
    for r in run_ranks(_kept_gradients, 2, timeout=60):
        assert r["torch"][0] == r["copies"][0] == r["views"][0] == [True] * 3
        assert r["views, detached"][0] == [True] * 3
        assert r["torch in backward"] and r["views in backward"]
        assert r["moves"] == [True, False, False]
        for name in ("copies", "views", "views, detached"):
            for ours, theirs in zip(r[name][1], r["torch"][1], strict=True):
                torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
