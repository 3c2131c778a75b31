"""The one-line swap: an ordinary Lightning script, trained with BucketDDP instead of "ddp".

    python examples/lightning_swap.py                     # BucketDDP on 2 CPU processes
    python examples/lightning_swap.py --strategy ddp      # Lightning's own DDP, to compare
    python examples/lightning_swap.py --sync-batchnorm    # bucketddp's SyncBatchNorm, on CPU

Nothing in the LightningModule knows about bucketddp, except the optional
``configure_buffer_sync`` hook: the "sum" policy makes ``examples_seen`` count the examples
of every rank, where torch DDP would overwrite it with rank 0's count. At the end rank 0
prints the loss, the counter and what the checkpoint holds for BucketDDP.

The same script runs under torchrun or SLURM unchanged; examples/torchrun_two_nodes.sh
starts it as two single-process "nodes" on one machine.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bucketddp import BucketDDP


class Classifier(pl.LightningModule):
    """A small MLP classifier with BatchNorm and an example counter."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 10)
        )
        self.register_buffer("examples_seen", torch.zeros((), dtype=torch.long))

    def configure_buffer_sync(self) -> dict[str, str]:
        # Only BucketDDP reads this hook; BatchNorm statistics keep the default "broadcast".
        return {"examples_seen": "sum"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.examples_seen += len(x)
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2048, 32, generator=g)
        y = (x[:, :10].argmax(dim=1) + (x[:, 10] > 1).long()) % 10  # a learnable rule
        return DataLoader(TensorDataset(x, y), batch_size=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="bucket_ddp", choices=["bucket_ddp", "ddp"])
    parser.add_argument("--devices", type=int, default=2, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sync-batchnorm", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    # The only line that differs from a plain Lightning DDP script. BucketDDP takes
    # sync_batchnorm itself too, so it has no Lightning plugin to replace (and no warning).
    bucket = BucketDDP(sync_batchnorm=args.sync_batchnorm)
    strategy = bucket if args.strategy == "bucket_ddp" else "ddp"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        sync_batchnorm=args.sync_batchnorm,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    model = Classifier()
    trainer.fit(model)

    # Every rank takes part in saving (buffers are synced first); rank 0 writes the file.
    path = trainer.strategy.broadcast(tempfile.mkdtemp() + "/last.ckpt")
    trainer.save_checkpoint(path, weights_only=False)  # the full state; says so to Lightning
    if trainer.is_global_zero:
        ckpt = torch.load(path, weights_only=False)
        print(
            f"strategy={type(trainer.strategy).__name__} world_size={trainer.world_size} "
            f"environment={type(trainer.strategy.cluster_environment).__name__}"
        )
        print(f"final train_loss={float(trainer.callback_metrics['train_loss']):.4f}")
        print(
            f"examples_seen={int(model.examples_seen)} (all ranks' examples with BucketDDP, "
            "rank 0's with ddp)"
        )
        if "bucketddp" in ckpt:
            print(f"checkpoint bucket order: {ckpt['bucketddp']['bucket_order']}")
        print(f"layers after fit: {sorted({type(m).__name__ for m in model.net})}")


if __name__ == "__main__":
    main()
