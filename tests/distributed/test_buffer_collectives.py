"""How many collectives a buffer sync makes, counted with the profiler on gloo ranks.

Buffers are coalesced: one all-reduce per policy and dtype group, in an explicit sync and in
the forward's, and one broadcast for every dtype under the default policy.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from bucketddp import BucketDataParallel
from buffer_models import BNNet
from multirank import run_ranks

TIMEOUT = 60.0


def collectives(prof: Any) -> list[str]:
    """The c10d collectives a profiler saw, one event per collective call."""
    return [e.name for e in prof.events() if e.name.startswith("c10d::")]


class ManyBuffers(nn.Module):
    """Six float buffers (mean), two long ones (sum), three kept per rank (none)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        for i, shape in enumerate([(4,), (2, 3), (), (5,), (1, 1), (7,)]):
            self.register_buffer(f"ema{i}", torch.zeros(shape))
        self.register_buffer("count0", torch.zeros((), dtype=torch.long))
        self.register_buffer("count1", torch.zeros(3, dtype=torch.long))
        self.register_buffer("seed", torch.zeros((), dtype=torch.long))
        self.register_buffer("noise", torch.zeros(3))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _count_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rules = {"ema*": "mean", "count*": "sum", "seed": "none", "noise": "none", "steps": "none"}
    ddp = BucketDataParallel(ManyBuffers(), buffer_sync=rules)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out["returned"] = ddp.sync_buffers()
    out["profiled"] = collectives(prof)
    out["groups"] = [(g.policy, str(g.dtype), len(g.names)) for g in ddp.buffers_sync.groups]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ddp(torch.randn(2, 4))  # the first training forward syncs the buffers
    out["forward"] = collectives(prof)

    # The default (broadcast) on three BatchNorm layers: nine buffers, two dtypes.
    bn = BucketDataParallel(BNNet())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out["bn_returned"] = bn.sync_buffers()
    out["bn_profiled"] = collectives(prof)
    return out


@pytest.fixture(scope="module")
def counts() -> list[dict[str, Any]]:
    return run_ranks(_count_worker, 2, timeout=TIMEOUT)


def test_one_collective_per_policy_and_dtype_group(counts: list[dict[str, Any]]) -> None:
    for r in counts:
        assert r["groups"] == [("mean", "torch.float32", 6), ("sum", "torch.int64", 2)]
        assert r["profiled"] == ["c10d::allreduce_", "c10d::allreduce_"]
        assert r["returned"] == 2


def test_forward_sync_is_coalesced_too(counts: list[dict[str, Any]]) -> None:
    for r in counts:
        assert r["forward"] == ["c10d::allreduce_", "c10d::allreduce_"]


def test_default_broadcast_is_one_collective_for_all_dtypes(
    counts: list[dict[str, Any]],
) -> None:
    # float32 statistics and int64 counters travel as bytes in a single broadcast.
    for r in counts:
        assert r["bn_profiled"] == ["c10d::broadcast_"]
        assert r["bn_returned"] == 1
