"""Benchmark the Lightning strategy: time per training step of BucketDDP against strategy="ddp".

For every benchmark model (see ``models.py``) both strategies fit the same LightningModule
(SGD with momentum, the model's synthetic batches) with ``Trainer(accelerator="cpu",
devices=2)``. Only the steps are timed, not process start-up or Trainer set-up: a callback
measures ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward with its
gradient sync, optimizer step), drops the warm-up steps, takes the median over the rest and
then the maximum over ranks, since the slowest rank sets the pace.

Both strategies run in the same two processes: Lightning's launcher starts them once and
the script fits one Trainer after another, alternating the strategies in interleaved rounds
(the order rotates each round) so that drifts of a busy machine hit both alike. The figure
per strategy is the median over rounds. Two ratios BucketDDP / ddp are reported (below 1 is
faster): of those medians, and the median of the per-round ratios, which pairs runs made
moments apart and so is the steadier of the two on a shared machine.

Usage::

    python benchmarks/bench_lightning.py             # all models, a few minutes on 2 cores
    python benchmarks/bench_lightning.py --quick     # smoke run
    python benchmarks/bench_lightning.py --models mlp --rounds 7 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import bucketddp
from bench_harness import LR, MOMENTUM
from bucketddp import BucketDDP
from models import MODELS, Batch, ModelSpec, count_parameters, loss_fn

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "lightning.json"
STRATEGIES = ("ddp", "bucket_ddp")


class Batches(Dataset[Batch]):
    """A fixed list of synthetic batches; an item is a whole batch (``batch_size=None``)."""

    def __init__(self, spec: ModelSpec, count: int, batch_size: int) -> None:
        self.batches = [spec.batch(batch_size, seed=i) for i in range(count)]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Batch:
        return self.batches[i]


class Bench(pl.LightningModule):
    """A benchmark model trained with cross-entropy and SGD with momentum."""

    def __init__(self, spec: ModelSpec, data: Batches) -> None:
        super().__init__()
        self.model = spec.build(seed=0)
        self.data = data

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return loss_fn(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    def train_dataloader(self) -> DataLoader[Batch]:
        return DataLoader(self.data, batch_size=None)


class StepTimer(pl.Callback):
    """Median seconds per training step after ``warmup`` steps, maximum over ranks."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self.median = float("nan")
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        local = torch.tensor(statistics.median(self.times[self.warmup :]), dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        self.median = float(local)


def time_fit(strategy: str, spec: ModelSpec, data: Batches, args: argparse.Namespace) -> float:
    """Fit once and return the median step time (max over ranks)."""
    timer = StepTimer(args.warmup)
    chosen: Any = BucketDDP() if strategy == "bucket_ddp" else strategy
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=chosen,
        max_steps=args.warmup + args.steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Bench(spec, data))
    return timer.median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per fit")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 10 steps")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 10, 3
    torch.set_num_threads(1)

    results: dict[str, Any] = {}
    rank = 0
    for name in args.models.split(","):
        spec = MODELS[name]
        # Enough batches that no rank runs out within one epoch.
        data = Batches(spec, (args.warmup + args.steps) * args.devices, spec.batch_size)
        times: dict[str, list[float]] = {s: [] for s in STRATEGIES}
        for round_ in range(args.rounds):
            order = STRATEGIES[round_ % 2 :] + STRATEGIES[: round_ % 2]
            for strategy in order:
                times[strategy].append(time_fit(strategy, spec, data, args))
        rank = dist.get_rank() if dist.is_initialized() else 0
        ddp, ours = (statistics.median(times[s]) for s in STRATEGIES)
        round_ratios = [b / d for d, b in zip(times["ddp"], times["bucket_ddp"], strict=True)]
        results[name] = {
            "parameters": count_parameters(spec.build()),
            "batch_size": spec.batch_size,
            "ddp_ms": round(ddp * 1e3, 3),
            "bucket_ddp_ms": round(ours * 1e3, 3),
            "ratio_of_medians": round(ours / ddp, 3),
            "median_round_ratio": round(statistics.median(round_ratios), 3),
            "rounds_ms": {s: [round(t * 1e3, 3) for t in v] for s, v in times.items()},
        }
    if rank != 0:
        return
    print(
        f"\n{'model':<12} {'params':>8} {'ddp ms/step':>12} {'BucketDDP ms/step':>18} "
        f"{'ratio of medians':>17} {'median round ratio':>19}"
    )
    for name, r in results.items():
        print(
            f"{name:<12} {r['parameters'] / 1e6:>7.2f}M {r['ddp_ms']:>12.2f} "
            f"{r['bucket_ddp_ms']:>18.2f} {r['ratio_of_medians']:>17.3f} "
            f"{r['median_round_ratio']:>19.3f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "bucketddp": bucketddp.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "devices": args.devices,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "argv": sys.argv[1:],
    }
    args.json.write_text(json.dumps({"meta": meta, "models": results}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
