"""A Fabric training loop with bucketddp: ``Fabric(strategy="ddp")`` swapped for BucketFabricDDP.

    python examples/fabric_loop.py                       # BucketFabricDDP on 2 CPU processes
    python examples/fabric_loop.py --strategy ddp        # Fabric's own DDP, to compare
    python examples/fabric_loop.py --fp16-hook --sync-batchnorm --accumulate 2

The loop is an ordinary Fabric loop. What bucketddp adds shows in three places: the model's
``configure_buffer_sync`` hook makes ``examples_seen`` count the examples of every rank;
``--sync-batchnorm`` normalizes over the global batch, on CPU; ``--fp16-hook`` compresses
gradients to float16 on the wire, which Fabric's DDP has no option for. ``fabric.save``
writes the model without its wrapper and ``fabric.load`` resumes from it. Rank 0 prints
the loss, the counter and what the checkpoint holds.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from bucketddp import BucketFabricDDP


class Classifier(nn.Module):
    """A small MLP classifier with BatchNorm and an example counter."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10)
        )
        self.register_buffer("examples_seen", torch.zeros((), dtype=torch.long))

    def configure_buffer_sync(self) -> dict[str, str]:
        # Only bucketddp reads this hook; BatchNorm statistics keep the default "broadcast".
        return {"examples_seen": "sum"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.examples_seen += len(x)
        return self.net(x)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 32, generator=g)
    return TensorDataset(x, (x[:, :10].argmax(dim=1)))


def train(fabric: Fabric, args: argparse.Namespace) -> None:
    """Train one epoch, save at its middle, and resume a fresh model from that checkpoint."""
    fabric.seed_everything(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(data(), batch_size=32, shuffle=True))
    path = Path(args.out) / "fabric.ckpt"
    loss = torch.zeros(())
    for i, (x, y) in enumerate(loader):
        last_micro = (i + 1) % args.accumulate == 0
        # Accumulate locally: forward and backward inside, no communication.
        with fabric.no_backward_sync(model, enabled=not last_micro):
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
        if last_micro:
            optimizer.step()
            optimizer.zero_grad()
        if i == len(loader) // 2:
            fabric.save(path, {"model": model, "optimizer": optimizer, "batch": i})

    fabric.save(path.with_name("final.ckpt"), {"model": model})  # syncs buffers first
    seen = int(model.examples_seen)
    fabric.print(f"{args.strategy}: loss {float(loss.detach()):.4f}, {seen} examples seen")

    # Resume: a fresh model and optimizer, restored in place.
    resumed = Classifier()
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
    resumed, resumed_opt = fabric.setup(resumed, resumed_opt)
    state: dict[str, Any] = {"model": resumed, "optimizer": resumed_opt, "batch": 0}
    fabric.load(path, state)
    fabric.print(f"resumed after batch {state['batch']}")
    if fabric.global_rank == 0 and args.strategy == "bucket_ddp":
        saved = torch.load(path, weights_only=True)
        fabric.print(f"checkpoint keys: {sorted(saved)}; model keys: {sorted(saved['model'])}")


OUT_VARIABLE = "FABRIC_LOOP_OUT"


def main() -> None:
    """Parse the flags and launch the loop on 2 CPU processes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", choices=["bucket_ddp", "ddp"], default="bucket_ddp")
    parser.add_argument("--fp16-hook", action="store_true", help="bucket: fp16 gradients")
    parser.add_argument("--sync-batchnorm", action="store_true", help="bucket: on CPU too")
    parser.add_argument("--accumulate", type=int, default=1, help="batches per step")
    parser.add_argument("--out", default=None, help="checkpoint folder (default: a new one)")
    args = parser.parse_args()

    if args.strategy == "ddp":
        strategy: Any = "ddp"
    else:
        strategy = BucketFabricDDP(
            sync_batchnorm=args.sync_batchnorm,
            ddp_comm_hook=default_hooks.fp16_compress_hook if args.fp16_hook else None,
        )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    args.out = args.out or os.environ.get(OUT_VARIABLE)  # the ranks rank 0 started
    if args.out is not None:
        fabric.launch(train, args)
        return
    # A folder of this run's own, so that two runs never share checkpoint names; the ranks
    # it starts inherit its name. fabric.load ends in a barrier, so no rank reads it late.
    with tempfile.TemporaryDirectory(prefix="fabric_loop-") as out:
        os.environ[OUT_VARIABLE] = args.out = out
        fabric.launch(train, args)


if __name__ == "__main__":
    main()
