"""The agreement row in each dtype of the last bucket: written and read through a host array
on the CPU (float32, float16, float64), through torch where NumPy lacks the dtype (bfloat16).
Either way the weights are torch DDP's, and a parameter missing on one rank is named on
every rank, at the step it went missing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from multirank import raised, run_ranks

STEPS = 3


class TwoHeads(nn.Module):
    """``a`` always gives the output; ``b`` only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def _batch(step: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 4, generator=g).to(dtype), torch.randn(8, 3, generator=g).to(dtype)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean squared error in elementwise ops: older torch releases (2.5 among them)
    have no ``mse_loss`` for float16 or bfloat16 on the CPU."""
    return ((out - y) ** 2).mean()


def _rank(rank: int, world: int, dtype_name: str) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    ours = BucketDataParallel(TwoHeads().to(dtype))
    torch.manual_seed(0)
    theirs = DDP(TwoHeads().to(dtype))
    for model in (ours, theirs):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            x, y = _batch(step, rank, dtype)
            _loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    row = ours.reducer.row
    same = all(
        torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters(), strict=True)
    )
    x, y = _batch(STEPS, rank, dtype)
    # Rank 1 leaves b out: every rank must name it, in this step.
    said = raised(lambda: _loss(ours(x, use_b=rank == 0), y).backward())
    return {"same": same, "host": row._first_host is not None, "said": said}


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16"])
def test_the_row_in_each_dtype_agrees_and_names_a_missing_parameter(dtype: str) -> None:
    for r in run_ranks(_rank, 2, dtype):
        assert r["same"], "weights differ from torch DDP's"
        assert r["host"] is (dtype != "bfloat16")
        assert "parameters ['b.weight', 'b.bias'] received no gradient" in r["said"], r["said"]
