"""A loss weighted by global class counts: buffer sync policies with Lightning on 2 CPUs.

The use case of pytorch/pytorch issue 63041. A binary classifier on imbalanced data weights
its positive examples by ``negatives / positives`` over everything seen so far, and keeps
those two counts in registered buffers, so that they travel with checkpoints. Each of the
two ranks trains on its own shard, and the shards differ: rank 0's is 10% positive, rank
1's 40%. The weight must come from the counts of **all** ranks, which the ``"sum"`` policy
gives: before each forward, every rank's additions since the last sync are added up.

torch DDP can only broadcast rank 0's buffers (or leave them alone). Broadcasting would
overwrite rank 1's counts with rank 0's at every step: the weight would be learned from
rank 0's shard alone, about 3 times too large here.

Two more buffers show the other common cases: a smoothed loss (an EMA) uses ``"mean"``,
and each rank's augmentation seed uses ``"none"``, so the ranks keep drawing different
noise. The LightningModule states all four in ``configure_buffer_sync``;
``Trainer(strategy=BucketDDP())`` picks them up.

Run it with ``python examples/buffer_policies.py``. Lightning starts the second process
itself. Rank 0 prints the counts and checks them against a direct count of the labels; the
exit status is 0 when every check passes.
"""

from __future__ import annotations

import sys

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bucketddp import BucketDDP

WORLD_SIZE = 2
STEPS = 40
BATCH = 64  # per rank
POSITIVE_RATE = (0.1, 0.4)  # per rank: the shards differ


class WeightedClassifier(L.LightningModule):
    """A small MLP whose loss up-weights positives by the global class ratio."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.register_buffer("pos_seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("neg_seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("loss_ema", torch.zeros(()))
        self.register_buffer("noise_seed", torch.zeros((), dtype=torch.long))
        # Plain attributes, not synced: what this example checks the buffers against.
        self.weights_used: list[torch.Tensor] = []
        self.labels_seen = torch.zeros(2, dtype=torch.long)

    def configure_buffer_sync(self) -> dict[str, str]:
        return {
            "pos_seen": "sum",  # every rank's additions, added up
            "neg_seen": "sum",
            "loss_ema": "mean",  # each rank's estimate is as good as any
            "noise_seed": "none",  # each rank keeps its own
        }

    def on_fit_start(self) -> None:
        self.noise_seed.fill_(1000 * (self.global_rank + 1))

    def pos_weight(self) -> torch.Tensor:
        """``negatives / positives`` seen so far, smoothed so that it starts at 1."""
        return ((self.neg_seen + 1) / (self.pos_seen + 1)).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        # The buffers were synced just before this step's forward, so every rank uses the
        # same weight; this batch is counted afterwards and joins the total at the next sync.
        weight = self.pos_weight()
        noise = torch.Generator().manual_seed(int(self.noise_seed))
        self.noise_seed += 1
        x = x + 0.05 * torch.randn(x.shape, generator=noise)
        loss = F.binary_cross_entropy_with_logits(self(x), y, pos_weight=weight)

        positives = int(y.sum())
        self.pos_seen += positives
        self.neg_seen += y.numel() - positives
        self.loss_ema.mul_(0.9).add_(0.1 * loss.detach())
        self.weights_used.append(weight)
        self.labels_seen += torch.tensor([positives, y.numel() - positives])
        return loss

    def train_dataloader(self) -> DataLoader:
        """This rank's own shard: labels drawn at the rank's positive rate."""
        rank = self.global_rank
        g = torch.Generator().manual_seed(rank)
        y = (torch.rand(STEPS * BATCH, generator=g) < POSITIVE_RATE[rank]).float()
        x = torch.randn(STEPS * BATCH, 8, generator=g) + y[:, None]
        return DataLoader(TensorDataset(x, y), batch_size=BATCH)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``t``, in rank order."""
    out = [torch.zeros_like(t) for _ in range(WORLD_SIZE)]
    dist.all_gather(out, t.contiguous())
    return out


def report(model: WeightedClassifier) -> bool:
    """Compare the synced buffers with direct counts; rank 0 prints. True if all agree."""
    truth = model.labels_seen.clone()
    dist.all_reduce(truth)
    counts = torch.stack([model.pos_seen, model.neg_seen])
    weights_by_rank = gather(torch.stack(model.weights_used))
    ema_by_rank = gather(model.loss_ema)
    seeds = [int(s) for s in gather(model.noise_seed)]
    rank0_alone = gather(model.labels_seen)[0]
    if dist.get_rank() != 0:
        return True

    checks = {
        "counts equal a direct count of all ranks' labels": torch.equal(counts, truth),
        "every step used the same weight on every rank": torch.equal(*weights_by_rank),
        "the loss EMA agrees across ranks": torch.equal(*ema_by_rank),
        "the ranks kept their own seeds": len(set(seeds)) == WORLD_SIZE,
    }
    alone_weight = (rank0_alone[1] + 1) / (rank0_alone[0] + 1)
    print(
        f"\nBuffer policies: {STEPS} steps of BucketDDP on {WORLD_SIZE} CPU processes (gloo), "
        f"batch {BATCH} per rank, positive rate {POSITIVE_RATE} by rank\n"
    )
    print(f"pos_seen, neg_seen (sum):  {counts.tolist()} (counted directly: {truth.tolist()})")
    print(f"final weight neg/pos:      {float(model.pos_weight()):.2f}")
    print(f"rank 0's shard alone:      {rank0_alone.tolist()}, weight {alone_weight:.2f}")
    print("                           (what broadcasting rank 0's counts would use)")
    print(f"loss_ema (mean):           {float(model.loss_ema):.4f} on every rank")
    print(f"noise_seed (none):         {seeds}\n")
    for name, passed in checks.items():
        print(f"{'ok  ' if passed else 'FAIL'} {name}")
    return all(checks.values())


def main() -> int:
    """Train on 2 processes; the exit status is 0 when every check passes."""
    torch.set_num_threads(1)  # two ranks share the machine's cores
    L.seed_everything(0, verbose=False)
    model = WeightedClassifier()
    trainer = L.Trainer(
        strategy=BucketDDP(),
        accelerator="cpu",
        devices=WORLD_SIZE,
        max_steps=STEPS,
        use_distributed_sampler=False,  # each rank brings its own shard
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)  # buffers are synced once more at the end of fit
    return 0 if report(model) else 1


if __name__ == "__main__":
    sys.exit(main())
