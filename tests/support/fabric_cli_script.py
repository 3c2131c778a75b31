"""A Fabric loop for the CLI: ``fabric run`` chooses the strategy; saves rank 0's weights.

    python -m bucketddp.lightning.fabric_cli run --accelerator cpu --devices 2 \
        --strategy bucket_ddp fabric_cli_script.py OUT
"""

from __future__ import annotations

import sys

import torch
from lightning.fabric import Fabric
from torch import nn

import bucketddp  # registers "bucket_ddp" in each rank, where Fabric() reads the CLI's choice

torch.set_num_threads(1)
fabric = Fabric()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
for step in range(4):
    gen = torch.Generator().manual_seed(100 * step + fabric.global_rank)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
    loss = nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
wrapper = type(fabric.strategy).__name__
if fabric.global_rank == 0:
    torch.save({"strategy": wrapper, "weights": model.state_dict()}, sys.argv[1])
assert isinstance(bucketddp.__version__, str)
# Leave no gloo thread behind at exit: torch aborts a process that exits with one running
# ("terminate called ..."), now and then, under "ddp" as well. Exits are test_exit.py's.
torch.distributed.destroy_process_group()
