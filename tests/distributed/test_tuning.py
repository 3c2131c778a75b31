"""bucket_cap_mb="auto": the tuning steps reduce like torch DDP, and every rank adopts one plan.

The plan, as checkpoints and snapshots keep it (``bucketddp.bucket_plan``), given to a new
wrapper: it adopts the sizes and the order, and its first step uses the tuned plan.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from bucketddp import BucketDataParallel
from bucketddp.bucket_plan import adopt_plan, plan_entry
from bucketddp.reducer.tuning import ROUNDS
from models import batch, build
from multirank import run_ranks

STEPS = 16


def _train(rank: int, world: int) -> dict[str, Any]:
    ours = BucketDataParallel(build("mlp"), bucket_cap_mb="auto")
    theirs = DistributedDataParallel(build("mlp"))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    plans, worst = [], 0.0
    for step in range(STEPS):
        x, y = batch("mlp", step, rank)
        for model, opt in zip((ours, theirs), opts, strict=True):
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        plans.append([b.names for b in ours.bucket_plan])
        for a, b in zip(ours.module.parameters(), theirs.module.parameters(), strict=True):
            worst = max(worst, (a - b).abs().max().item())
    tuner = ours.reducer.tuner
    assert tuner is not None
    entry = plan_entry(ours)
    resumed = BucketDataParallel(build("mlp"), bucket_cap_mb="auto")
    adopted = adopt_plan(resumed, entry)
    x, y = batch("mlp", STEPS, rank)
    F.mse_loss(resumed(x), y).backward()
    return {
        "worst": worst,
        "plans": plans,
        "choice": ours.tuned_bucket_sizes,
        "tried": len(tuner.medians),
        "entry": entry,
        "adopted": adopted,
        "resumed": ([b.names for b in resumed.bucket_plan], resumed.tuned_bucket_sizes),
    }


def test_auto_bucket_sizes_give_torch_ddps_weights_through_tuning() -> None:
    results = run_ranks(_train, 2)
    for r in results:
        # Through every candidate plan, the weights stay torch DDP's.
        assert r["worst"] < 1e-6, r["worst"]
        assert r["tried"] >= 2  # one bucket, halves, quarters... (distinct plans only)
        assert r["choice"] is not None
        assert len({len(p) for p in r["plans"]}) >= 2  # the plans changed during tuning
        # Chosen by the end of tuning: the plan stays put afterwards.
        done = 1 + ROUNDS * r["tried"]
        assert all(p == r["plans"][done] for p in r["plans"][done:])
    assert results[0]["choice"] == results[1]["choice"]
    assert results[0]["plans"] == results[1]["plans"]
    for r in results:
        assert sorted(r["entry"]) == ["bucket_order", "bucket_sizes"]
        assert r["adopted"] == (True, True)
        assert r["resumed"] == (r["plans"][-1], r["choice"])  # no tuning again
