"""Does training still converge with a communication hook? The demo's model, four ways.

``python3 dev.py convergence`` trains examples/demo.py's MLP on scikit-learn's handwritten
digits on 2 CPU ranks (gloo) with four gradient reductions: fp32 (no hook), bf16 and fp16
(torch's compress hooks) and PowerSGD of rank 1 (torch's ``powerSGD_hook``), each under
bucketddp and under torch DDP. All eight train in one pair of processes, one step each in
turn in a balanced order (``round_order``), from the same initial weights on the same
batches, so a busy machine slows them alike. Every few steps each is scored on the held-out
images, outside the timed steps. It prints the final accuracy of each, writes the curves to
benchmarks/results/convergence.json and draws accuracy against step and against training
time in docs/images/convergence.png.

torch DDP refuses a hook named ``bf16_compress_hook`` (or ``bf16_compress_wrapper_hook``)
unless NCCL 2.10+ or XCCL is present, though gloo sums bfloat16 on CPU. bucketddp runs
torch's hook; torch DDP runs ``bf16_allreduce_hook`` (tools/bf16.py), the same
arithmetic under another name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from bench_harness import round_order, run_ranks  # also puts tools/ on sys.path
from bf16 import bf16_allreduce_hook  # tools/bf16.py
from bucketddp import BucketDataParallel

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "examples"))
import demo  # noqa: E402  (examples/demo.py: the data, the model, the step)

SYSTEMS = ("bucketddp", "torch DDP")
POWERSGD_RANK = 1
BUCKET_MB = 25.0
"""One bucket for the whole model in both wrappers: torch DDP with PowerSGD on gloo stops
with a size mismatch when there are two (docs/comm-hooks.md), and one layout for every run
keeps their times comparable."""


Hook = Callable[[str], tuple[Any, Callable[..., Any]] | None]
"""A hook's (state, hook) for one system, built fresh: PowerSGD keeps state per wrapper."""

HOOKS: dict[str, Hook] = {
    "fp32": lambda system: None,
    "bf16": lambda system: (
        None,
        default_hooks.bf16_compress_hook if system == "bucketddp" else bf16_allreduce_hook,
    ),
    "fp16": lambda system: (None, default_hooks.fp16_compress_hook),
    f"PowerSGD rank {POWERSGD_RANK}": lambda system: (
        powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=2,  # the earliest torch allows: compressed from the 2nd step
        ),
        powerSGD_hook.powerSGD_hook,
    ),
}


def wrap(system: str, hook: str, seed: int) -> nn.Module:
    """The demo's model, seeded, in ``system``'s wrapper with ``hook`` registered."""
    model = demo.build_model(seed)
    wrapped: nn.Module
    if system == "bucketddp":
        wrapped = BucketDataParallel(model, bucket_cap_mb=BUCKET_MB, first_bucket_mb=BUCKET_MB)
    else:
        wrapped = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    registered = HOOKS[hook](system)
    if registered is not None:
        wrapped.register_comm_hook(*registered)  # type: ignore[operator]
    return wrapped


def train_all(rank: int, world_size: int, epochs: int, eval_every: int, seed: int) -> dict:
    """Train every (hook, system) in turn, one step each; returns their curves: per scoring,
    the step, the training seconds so far (slowest rank) and the held-out accuracy."""
    data = demo.load_digits_split()
    runs = [(hook, system) for hook in HOOKS for system in SYSTEMS]
    models = {run: wrap(run[1], run[0], seed) for run in runs}
    optimizers = {
        run: torch.optim.SGD(m.parameters(), lr=demo.LR, momentum=demo.MOMENTUM)
        for run, m in models.items()
    }
    seconds = dict.fromkeys(runs, 0.0)
    step_seconds: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    curves: dict[tuple[str, str], list[tuple[int, float, float]]] = {run: [] for run in runs}
    steps = epochs * data.steps_per_epoch(world_size)
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            for run in runs:
                acc = demo.accuracy(models[run], data, rank, world_size)
                curves[run].append((step, seconds[run], acc))
        if step == steps:
            break
        x, y = demo.shard(data, step, rank, world_size, seed)
        for run in round_order(runs, step):
            _, elapsed = demo.timed_step(models[run], optimizers[run], x, y)
            seconds[run] += elapsed
            step_seconds[run].append(elapsed)
    difference = {
        hook: demo.max_difference(
            models[hook, "bucketddp"].module,  # type: ignore[arg-type]
            models[hook, "torch DDP"].module,  # type: ignore[arg-type]
        )
        for hook in HOOKS
    }
    return {
        "steps": steps,
        "curves": {f"{h}|{s}": c for (h, s), c in curves.items()},
        "median_step_ms": {
            f"{h}|{s}": 1000 * statistics.median(t[demo.WARMUP :])
            for (h, s), t in step_seconds.items()
        },
        "max_difference": difference,
    }


def final_accuracy(results: list[dict], key: str) -> list[float]:
    """The last scoring's accuracy of run ``key`` ("hook|system"), one per seed."""
    return [r["curves"][key][-1][2] for r in results]


def table(results: list[dict]) -> str:
    """Markdown: final held-out accuracy (mean over seeds, and the range) and the median
    time per step, per hook and system, and the largest weight difference between them."""
    seeds = len(results)
    lines = [
        "| hook | bucketddp | torch DDP | max weight difference | ms/step bucketddp | "
        "ms/step torch DDP |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for hook in HOOKS:
        cells = [hook]
        for system in SYSTEMS:
            accs = [100 * a for a in final_accuracy(results, f"{hook}|{system}")]
            spread = f" ({min(accs):.1f}-{max(accs):.1f})" if seeds > 1 else ""
            cells.append(f"{statistics.mean(accs):.1f}%{spread}")
        diff = max(r["max_difference"][hook] for r in results)
        cells.append(f"{diff:.1e}" if diff else "0")
        for system in SYSTEMS:
            ms = [r["median_step_ms"][f"{hook}|{system}"] for r in results]
            cells.append(f"{statistics.median(ms):.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw(results: list[dict], path: Path) -> None:
    """Held-out accuracy against step and against training time, averaged over seeds."""
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    colors = dict(zip(HOOKS, ("black", "tab:blue", "tab:orange", "tab:green"), strict=True))
    styles = dict(zip(SYSTEMS, ("-", "--"), strict=True))
    for hook in HOOKS:
        for system in SYSTEMS:
            key = f"{hook}|{system}"
            points = list(zip(*(r["curves"][key] for r in results), strict=True))
            steps = [p[0][0] for p in points]
            seconds = [statistics.mean(s for _, s, _ in p) for p in points]
            accs = [100 * statistics.mean(a for _, _, a in p) for p in points]
            style = {"color": colors[hook], "linestyle": styles[system], "linewidth": 1.4}
            by_step.plot(steps, accs, label=f"{hook}, {system}", **style)
            by_time.plot(seconds, accs, **style)
    by_step.set_xlabel("step (global batch of 64 images)")
    by_time.set_xlabel("training time (s, sum of the timed steps, slowest rank)")
    by_step.set_ylabel("held-out accuracy (%)")
    for ax in (by_step, by_time):
        ax.set_ylim(50, 100)
        ax.grid(alpha=0.3)
    fig.legend(loc="lower center", ncols=4, fontsize=8, frameon=False)
    fig.suptitle(
        f"Digits MLP on 2 CPU ranks (gloo), mean of {len(results)} seed(s): "
        "solid bucketddp, dashed torch DDP",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=demo.EPOCHS)
    p.add_argument("--eval-every", type=int, default=5, help="steps between scorings")
    p.add_argument("--seeds", type=int, default=3, help="runs from different initial weights")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/convergence.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs/images/convergence.png")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Train every hook under both systems, print the table, write the JSON and the plot."""
    args = parse_args(argv)
    results = []
    for seed in range(args.seeds):
        print(f"seed {seed}: training {len(HOOKS) * len(SYSTEMS)} models ...", flush=True)
        ranks = run_ranks(
            train_all, demo.WORLD_SIZE, args.epochs, args.eval_every, seed, timeout=900
        )
        results.append(ranks[0])
    print(
        f"\n{results[0]['steps']} steps ({args.epochs} epochs), final held-out accuracy, "
        f"mean over {args.seeds} seed(s) (range):\n"
    )
    print(table(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    draw(results, args.plot)
    print(f"\nwrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
