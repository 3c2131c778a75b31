"""The default "broadcast" buffer policy against torch DDP, on real gloo process groups.

BatchNorm statistics trained with both wrappers, through evaluation, no_sync() and inference
mode forwards, must match torch DDP's exactly; policies first synced under inference mode
must keep working afterwards.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from bucketddp import BucketDataParallel
from buffer_models import BNNet
from multirank import run_ranks

TIMEOUT = 60.0


def _vs_ddp_worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = BNNet()
    if rank == 1:  # both wrappers must start from rank 0's values
        with torch.no_grad():
            for t in [*base.parameters(), *base.buffers()]:
                t.add_(1)
    ours = BucketDataParallel(copy.deepcopy(base))
    theirs = DistributedDataParallel(copy.deepcopy(base))
    runs = [(ours, torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)),
            (theirs, torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9))]  # fmt: skip
    for model, _ in runs:
        # An evaluation before training, under inference mode: the first buffer sync runs
        # there. Before, its flat buffer was an inference tensor that the next sync, outside
        # inference mode, could not write to.
        model.eval()
        with torch.inference_mode():
            model(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank)))
        model.train()
    for step in range(8):
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        for model, opt in runs:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 2:  # an eval forward changes when the next sync happens
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
            if step == 5:  # so does a forward under no_sync()
                with model.no_sync():  # type: ignore[operator]
                    model(x).sum().backward()
                opt.zero_grad()
    return {
        name: {
            "buffers": {n: b.clone() for n, b in model.module.named_buffers()},
            "params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
        }
        for name, (model, _) in zip(("ours", "theirs"), runs, strict=True)
    }


@pytest.fixture(scope="module")
def vs_ddp() -> list[dict[str, Any]]:
    return run_ranks(_vs_ddp_worker, 2, timeout=TIMEOUT)


@pytest.mark.compat("buffers")
def test_default_broadcast_matches_torch_ddp_exactly(vs_ddp: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(vs_ddp):
        for kind in ("buffers", "params"):
            for name, theirs in r["theirs"][kind].items():
                ours = r["ours"][kind][name]
                assert torch.equal(ours, theirs), f"rank {rank} {kind} {name}"


def _inference_first(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = BNNet()
    rules = {"body.*.running_*": "mean", "body.*.num_batches_tracked": "sum"}
    wrapped = BucketDataParallel(model, buffer_sync=rules)
    with torch.inference_mode():
        wrapped.sync_buffers()  # the first sync of each group, in inference mode
    for step in range(2):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        wrapped(x).square().mean().backward()
    wrapped.sync_buffers()
    return {n: b.clone() for n, b in model.named_buffers()}


def test_policies_first_synced_under_inference_mode_keep_working() -> None:
    r0, r1 = run_ranks(_inference_first, 2, timeout=TIMEOUT)
    for name, value in r0.items():
        assert torch.equal(value, r1[name]), name
    # Two forwards on each of two ranks, counted once each: the "sum" baseline held.
    assert int(r0["body.1.num_batches_tracked"]) == 4


def test_ranks_buffers_differ_after_the_last_local_forward(vs_ddp: list[dict[str, Any]]) -> None:
    # The comparison above is not vacuous: the last forward updated each rank's running
    # statistics from its own batch, as torch DDP does.
    a, b = (r["ours"]["buffers"]["body.1.running_mean"] for r in vs_ddp)
    assert not torch.equal(a, b)
