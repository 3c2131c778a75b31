"""A script that names our strategies but never imports bucketddp (check_wheel.py runs it).

    python names_without_import.py trainer   # Trainer(strategy="bucket_ddp", devices=2)
    fabric run --accelerator cpu --devices 2 --strategy bucket_ddp names_without_import.py fabric

Only the interpreter-start hook the wheel installs (bucketddp-strategy-names.pth) can make
"bucket_ddp" known here. Each mode trains a few steps on 2 CPU processes and checks, on
every rank, that the strategy is ours and that its wrapper reduced the gradients (the ranks
see different batches yet end with the same weights). Rank 0 prints "names OK: ...".
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WRAPPER = "BucketDataParallel"


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(8, 8, generator=gen), torch.randn(8, 2, generator=gen)) for _ in range(steps)
    ]


def _same_on_every_rank(model: nn.Module) -> None:
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered), "ranks' weights differ"


def trainer() -> None:
    """``Trainer(strategy="bucket_ddp")`` fits on 2 CPU processes."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 2)
            self.wrapper = ""

        def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
            assert self.trainer is not None
            self.wrapper = type(self.trainer.strategy.model).__name__
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
            x, y = (torch.cat(t) for t in zip(*_batches(self.global_rank, 4), strict=True))
            return DataLoader(TensorDataset(x, y), batch_size=8)

    torch.manual_seed(0)
    module = Module()
    fit = pl.Trainer(
        strategy="bucket_ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    fit.fit(module)
    strategy = type(fit.strategy).__name__
    assert strategy == "BucketDDP" and module.wrapper == WRAPPER, (strategy, module.wrapper)
    _same_on_every_rank(module)
    if fit.global_rank == 0:
        print(f"names OK: Trainer(strategy='bucket_ddp') fit with {strategy} on 2 processes")


def fabric() -> None:
    """``fabric run --strategy bucket_ddp`` chose our strategy, which trains."""
    from lightning.fabric import Fabric

    run = Fabric()  # everything comes from `fabric run`'s options
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = run.setup(model, optimizer)
    for x, y in _batches(run.global_rank, 4):
        run.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    strategy, wrapper = type(run.strategy).__name__, type(model._forward_module).__name__
    assert strategy == "BucketFabricDDP" and wrapper == WRAPPER, (strategy, wrapper)
    _same_on_every_rank(model)
    if run.global_rank == 0:
        print(f"names OK: fabric run --strategy bucket_ddp trained with {strategy}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    assert "bucketddp" not in sys.modules
    torch.set_num_threads(1)
    {"trainer": trainer, "fabric": fabric}[sys.argv[1]]()
