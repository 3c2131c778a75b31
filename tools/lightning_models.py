"""LightningModules and callbacks shared by the strategy scenarios
(tests/support/lightning_scenarios.py) and the Lightning fuzzer (fuzz_lightning.py).

Every model draws its weights and its data from fixed seeds, so two strategies trained in
the same process group from the same seed see identical weights and batches.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.demos.transformer import LightningTransformer
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

QUIET: dict[str, Any] = {
    "accelerator": "cpu",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
"""Trainer options every scenario shares."""


def fingerprint(module: nn.Module, skip: tuple[str, ...] = ()) -> torch.Tensor:
    """All parameters and buffers of ``module`` (bar names containing ``skip``), as one vector."""
    parts = [
        t.detach().float().reshape(-1).cpu()
        for name, t in [*module.named_parameters(), *module.named_buffers()]
        if not any(s in name for s in skip)
    ]
    return torch.cat(parts)


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the state dict."""
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def hook_count(module: nn.Module) -> int:
    """Post-accumulate-grad hooks left on the module's parameters."""
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in module.parameters())


# ------------------------------------------------------------------------ demo models
class Boring(BoringModel):
    """Lightning's BoringModel; the scenarios run it with ``limit_val_batches=0``."""


class RankLocalBias(Boring):
    """``layer.bias`` is in torch DDP's ignore list and starts at a different value per rank."""

    def __init__(self) -> None:
        super().__init__()
        self._ddp_params_and_buffers_to_ignore = ["layer.bias"]

    def setup(self, stage: str) -> None:
        # Runs on every rank before the strategy wraps the module.
        with torch.no_grad():
            self.layer.bias.add_(self.global_rank)


class _Tokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Synthetic next-token pairs for the demo Transformer (no WikiText download)."""

    def __init__(self, vocab: int, length: int, seq: int = 12) -> None:
        g = torch.Generator().manual_seed(7)
        self.data = torch.randint(0, vocab, (length, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class Transformer(LightningTransformer):
    """Lightning's demo Transformer LightningModule with a small vocabulary, fed synthetic data."""

    VOCAB = 64

    def __init__(self) -> None:
        super().__init__(vocab_size=self.VOCAB)

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_Tokens(self.VOCAB, 64), batch_size=4)


# ------------------------------------------------------------------ lifecycle model
ADDED_PER_STEP = 3
"""What each rank adds to the "sum" buffer ``seen`` in every training step."""


def _table(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g))


class Counting(pl.LightningModule):
    """BatchNorm ("broadcast"), a "sum" counter, a "none" buffer, Adam, a torchmetrics metric
    and a ``sync_dist`` log: one model for the whole fit/checkpoint/resume cycle.

    With 32 training rows in batches of 4, an epoch is 4 steps at world size 2 and 8 at
    world size 1.
    """

    def __init__(self, policies: bool = True) -> None:
        super().__init__()
        self.policies = policies
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("local_mark", torch.zeros(()))
        self.val_total = torchmetrics.SumMetric()

    def configure_buffer_sync(self) -> dict[str, str]:
        return {"seen": "sum", "local_*": "none"} if self.policies else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen.add_(ADDED_PER_STEP)
        self.local_mark.fill_(self.global_rank + 1)
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        mark = float(self.global_rank + 1)
        # Global values: sum over ranks of (rank + 1), and the metric summed over all batches.
        self.log("val_rank_sum", mark, sync_dist=True, reduce_fx="sum", batch_size=len(x))
        self.val_total.update(torch.tensor(mark))
        self.log("val_total", self.val_total, on_step=False, on_epoch=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_table(32, 1), batch_size=4)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_table(8, 2), batch_size=2)

    def test_dataloader(self) -> DataLoader[Any]:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader[Any]:
        return self.val_dataloader()


class Unused(Counting):
    """A layer that never reaches the loss: the reducer's error must name it."""

    def __init__(self) -> None:
        super().__init__()
        self.idle = nn.Linear(8, 8)


class NanOnRank1(Counting):
    """At step 2, rank 1's gradient of ``net.3.weight`` is NaN: the finite check names it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and batch_idx == 2:
            loss = loss + self.net[3].weight.sum() * float("nan")
        return loss


class Normed(pl.LightningModule):
    """BatchNorm layers for the sync_batchnorm runs; the batch differs per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_table(32, 3), batch_size=4)

    def predict_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_table(8, 4), batch_size=4)


class Zero(Counting):
    """Counting with torch's ZeroRedundancyOptimizer (optimizer state sharded over ranks)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.Adam, lr=0.05)


class GAN(pl.LightningModule):
    """Manual optimization with two optimizers, ``toggle_model`` and accumulation over two
    batches: gradients are synced only on the second batch of each pair."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.dis = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        sync = batch_idx % 2 == 1

        def gen_closure() -> None:
            loss = -self.dis(self.gen(x)).mean() / 2
            self.manual_backward(loss)

        def dis_closure() -> None:
            loss = (self.dis(self.gen(x).detach()).mean() - self.dis(x).mean()) / 2
            self.manual_backward(loss)

        with opt_g.toggle_model(sync_grad=sync):
            gen_closure()
            if sync:
                opt_g.step()
                opt_g.zero_grad()
        with opt_d.toggle_model(sync_grad=sync):
            dis_closure()
            if sync:
                opt_d.step()
                opt_d.zero_grad()

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.gen.parameters(), lr=0.05),
            torch.optim.SGD(self.dis.parameters(), lr=0.05),
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_table(32, 4), batch_size=4)


class ManualBatchNorm(pl.LightningModule):
    """Manual optimization with BatchNorm: records the running mean each training step sees."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.seen.append(self.net[1].running_mean.detach().clone())
        opt = self.optimizers()
        self.manual_backward(F.mse_loss(self.net(x), y.float().unsqueeze(1)))
        opt.step()  # type: ignore[union-attr]
        opt.zero_grad()  # type: ignore[union-attr]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_table(32, 5), batch_size=4)


class MLP(pl.LightningModule):
    """Parameters only, no buffers: every all-reduce in training is a gradient bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_table(64, 5), batch_size=4)


class Finetuned(pl.LightningModule):
    """A backbone that BackboneFinetuning freezes before wrapping and unfreezes at epoch 1.

    32 rows: 4 steps per epoch both at world size 2 (batches of 4 per rank) and at world
    size 1 (batches of 8). Under DDP, Lightning's DistributedSampler shuffles with seed 0 and
    rank r takes every other row of the permutation; with ``global_batches`` one process
    draws the same permutation, so each of its steps sees the union of the ranks' rows.
    """

    def __init__(self, batch_size: int = 4, global_batches: bool = False) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.global_batches = global_batches
        self.backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(trainable, lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        rows = _table(32, 6)
        if not self.global_batches:
            return DataLoader(rows, batch_size=self.batch_size)
        order = DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(rows, batch_size=self.batch_size, sampler=order)


# ----------------------------------------------------------------------- callbacks
class CountAllReduces(pl.Callback):
    """Counts ``c10d::allreduce_`` calls between the first and the last training batch."""

    def __init__(self) -> None:
        self.count = 0
        self.buckets = 0
        self._prof: torch.profiler.profile | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._prof.start()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._prof is not None
        self._prof.stop()
        self.count = sum(1 for e in self._prof.events() if e.name == "c10d::allreduce_")
        self.buckets = len(trainer.strategy.model.bucket_plan)  # type: ignore[arg-type]


class WrapperAttribute(pl.Callback):
    """Reads an attribute of the wrapper the strategy trains (``static_graph``, say)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.value: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.value = getattr(trainer.strategy.model, self.name)


class SyncedBatches(pl.Callback):
    """Records the batches after which the reducer had completed a new synced backward."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self._last: object = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = getattr(trainer.strategy.model, "comm_stats", None)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        stats = getattr(trainer.strategy.model, "comm_stats", None)
        if stats is not None and stats is not self._last:
            self.batches.append(args[-1])
            self._last = stats


class GradNorms(pl.Callback):
    """The gradient norm each step sees before clipping (after the backward's reduction)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        grads = [p.grad.reshape(-1) for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.cat(grads).norm()))


class Observe(pl.Callback):
    """What the strategy looks like from inside each stage of a run."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def _record(self, stage: str, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if stage in self.seen:
            return
        model = trainer.strategy.model
        self.seen[stage] = {
            "wrapper": type(model).__name__,
            "bucket_order": getattr(model, "bucket_order", None),
            # "none" buffers differ by design; everything else must agree across ranks.
            "state": fingerprint(pl_module, skip=("local_",)),
            "norm_layers": sorted(
                {
                    type(m).__name__
                    for m in pl_module.modules()
                    if isinstance(m, nn.modules.batchnorm._BatchNorm)
                }
            ),
        }

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # As Lightning's own DDP tests do: a barrier before the model is wrapped ...
        self.seen.setdefault("setup_wrapper", type(trainer.strategy.model).__name__)
        trainer.strategy.barrier("before wrapping")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record("train_start", trainer, pl_module)
        trainer.strategy.barrier("after wrapping")  # ... and one after

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        stage = "validate" if trainer.state.fn == "validate" else "fit_validation"
        if not trainer.sanity_checking:
            self._record(stage, trainer, pl_module)

    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        self._record("test", trainer, pl_module)

    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        self._record("predict", trainer, pl_module)


class RegisterCommHook(pl.Callback):
    """Registers a communication hook on the wrapped model once fit has wrapped it."""

    def __init__(self, hook: Any, state: Any = None) -> None:
        self.hook, self.state = hook, state

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(self.state, self.hook)  # type: ignore[union-attr]


class RecordingCheckpointIO(TorchCheckpointIO):
    """Writes checkpoints as usual and notes which rank wrote each one."""

    def __init__(self, log_dir: str) -> None:
        super().__init__()
        self.log_dir = log_dir

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        rank = os.environ.get("LOCAL_RANK", "0")
        with open(os.path.join(self.log_dir, "writers.txt"), "a") as f:
            f.write(f"{rank}\n")
