"""Models that more than one buffer-sync test file trains (tests/distributed/test_buffer_*.py)."""

from __future__ import annotations

import torch
from torch import nn


class BNNet(nn.Module):
    """Three BatchNorm1d layers: nine buffers in two dtypes (float32 statistics, int64 counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(),
            nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(),
            nn.Linear(8, 3), nn.BatchNorm1d(3),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)
