"""Benchmark SyncBatchNorm: step-time overhead against plain BatchNorm, 2 ranks over gloo.

Two systems train the benchmark conv net (``models.py``, four Conv-BatchNorm-ReLU blocks)
in ``BucketDataParallel`` with SGD and momentum:

- ``batchnorm``: the model as it is; each rank normalizes by its own batch, and the
  running statistics are broadcast from rank 0 before every forward (one collective);
- ``syncbn``: the model after ``convert_sync_batchnorm``; every BatchNorm layer does one
  all-reduce in forward and one in backward, and the running statistics need no broadcast.

torch's own ``nn.SyncBatchNorm`` is not a third system: it refuses CPU input in training.

Both systems live in one pair of processes and run in interleaved rounds, the order
alternating every round, so that drifts of a busy machine land on both alike. A step's time
is the max over ranks. The report gives each system's median step time, the ratio of the
medians, the median of the per-round ratios, and the overhead per step and per layer.

Usage::

    python benchmarks/bench_syncbn.py                       # about a minute on 2 cores
    python benchmarks/bench_syncbn.py --quick
    python benchmarks/bench_syncbn.py --batch-size 64 --json benchmarks/results/syncbn.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import bucketddp
from bench_harness import (
    LR,
    MOMENTUM,
    RANKS_TIMEOUT,
    loadavg,
    over_ranks,
    run_meta,
    run_ranks,
    train_steps,
)
from bucketddp import BucketDataParallel, convert_sync_batchnorm
from models import MODELS

SYSTEMS = ("batchnorm", "syncbn")
MODEL = "convnet"


@dataclass(frozen=True)
class Config:
    """The knobs of one run, shipped to every rank."""

    rounds: int
    steps: int
    warmup: int
    batch_size: int


def build(system: str) -> nn.Module:
    """The conv net as ``system`` trains it, wrapped for data parallelism."""
    model = MODELS[MODEL].build(seed=0)
    if system == "syncbn":
        model = convert_sync_batchnorm(model)
    return BucketDataParallel(model)


def time_systems(rank: int, world_size: int, cfg: Config) -> dict[str, Any]:
    """Interleaved rounds of both systems; per system and round, the step times in seconds
    (max over ranks), and the forward/backward split (mean over ranks)."""
    spec = MODELS[MODEL]
    models = {s: build(s) for s in SYSTEMS}
    optimizers = {
        s: torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for s, m in models.items()
    }
    layers = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in models["syncbn"].modules())
    per_round: dict[str, list[list[list[float]]]] = {s: [] for s in SYSTEMS}
    for r in range(cfg.rounds):
        batches = [
            spec.batch(cfg.batch_size, seed=1_000_000 * r + 1000 * rank + i)
            for i in range(cfg.warmup + cfg.steps)
        ]
        order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
        for s in order:
            model, opt = models[s], optimizers[s]
            dist.barrier()
            # total, forward and backward seconds of each step
            rows = [row[:3] for row in train_steps(model, opt, batches)]
            per_round[s].append(over_ranks(rows[cfg.warmup :], world_size, "cpu"))
    return {"per_round": per_round, "bn_layers": layers}


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Medians (ms), the syncbn/batchnorm ratios and the overhead per step and per layer."""
    out: dict[str, Any] = {"bn_layers": raw["bn_layers"], "systems": {}}
    for s in SYSTEMS:
        rounds = raw["per_round"][s]
        steps = [row for rnd in rounds for row in rnd]
        totals = sorted(1000 * row[0] for row in steps)
        out["systems"][s] = {
            "median_ms": statistics.median(totals),
            "p25_ms": totals[len(totals) // 4],
            "p75_ms": totals[(3 * len(totals)) // 4],
            "forward_ms": statistics.median(1000 * row[1] for row in steps),
            "backward_ms": statistics.median(1000 * row[2] for row in steps),
            "round_medians_ms": [statistics.median(1000 * row[0] for row in rnd) for rnd in rounds],
        }
    sync, plain = out["systems"]["syncbn"], out["systems"]["batchnorm"]
    round_ratios = [
        a / b for a, b in zip(sync["round_medians_ms"], plain["round_medians_ms"], strict=True)
    ]
    out["ratio_of_medians"] = sync["median_ms"] / plain["median_ms"]
    out["median_round_ratio"] = statistics.median(round_ratios)
    out["round_ratios"] = round_ratios
    out["overhead_ms_per_step"] = sync["median_ms"] - plain["median_ms"]
    out["overhead_ms_per_layer"] = out["overhead_ms_per_step"] / raw["bn_layers"]
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``--quick`` fills in small values for the options left unset."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 10; quick 2)")
    p.add_argument(
        "--steps", type=int, help="timed steps per system and round (default 10; quick 4)"
    )
    p.add_argument("--warmup", type=int, help="untimed steps before them (default 2; quick 1)")
    p.add_argument(
        "--batch-size", type=int, default=MODELS[MODEL].batch_size, help="per-rank batch size"
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: few rounds and steps")
    p.add_argument("--json", type=Path, help="also write the full results to this file")
    args = p.parse_args(argv)
    for key, (full, quick) in {"rounds": (10, 2), "steps": (10, 4), "warmup": (2, 1)}.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or args.batch_size < 1:
        p.error("--rounds, --steps and --batch-size must be >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Time both systems, print the summary and write the JSON if asked to."""
    args = parse_args(argv)
    cfg = Config(args.rounds, args.steps, args.warmup, args.batch_size)
    started = time.perf_counter()
    load_start = loadavg()
    print(
        f"bucketddp {bucketddp.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load {load_start}; {MODEL}, per-rank batch {cfg.batch_size}, world size 2 (gloo); "
        f"{cfg.rounds} rounds x ({cfg.warmup} warmup + {cfg.steps} timed steps) per system"
    )
    res = summarize(run_ranks(time_systems, 2, cfg, timeout=RANKS_TIMEOUT)[0])

    header = f"{'system':<10} {'step ms':>8} {'p25-p75 ms':>13} {'fwd ms':>7} {'bwd ms':>7}"
    print(f"\n{header}\n{'-' * len(header)}")
    for s, f in res["systems"].items():
        print(
            f"{s:<10} {f['median_ms']:8.2f} {f['p25_ms']:6.2f}-{f['p75_ms']:<6.2f} "
            f"{f['forward_ms']:7.2f} {f['backward_ms']:7.2f}"
        )
    ratios = res["round_ratios"]
    print(
        f"\nsyncbn/batchnorm: {res['ratio_of_medians']:.3f} (ratio of medians), "
        f"{res['median_round_ratio']:.3f} (median of {len(ratios)} round ratios, range "
        f"{min(ratios):.3f}-{max(ratios):.3f})"
    )
    print(
        f"overhead: {res['overhead_ms_per_step']:+.2f} ms per step, "
        f"{res['overhead_ms_per_layer']:+.2f} ms per layer ({res['bn_layers']} BatchNorm layers, "
        "2 all-reduces each)"
    )
    load_end = loadavg()
    seconds = round(time.perf_counter() - started, 1)
    print(f"load average {load_start} -> {load_end}; {seconds:.0f}s in all")
    if args.json is not None:
        report = {
            "meta": run_meta(
                world_size=2,
                model=MODEL,
                loadavg_start=load_start,
                loadavg_end=load_end,
                seconds=seconds,
            ),
            "config": asdict(cfg),
            "results": res,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
