"""Collectives per step, with and without elastic snapshots: the snapshots add none.

On each model, 2 ranks (gloo, CPU, one thread each) train ``BucketDataParallel``, plain and
with an ``Elastic`` helper taking a snapshot every step, each in the environment torchrun
would give it. torch's profiler records every collective a rank issues through
``torch.distributed`` (each ``c10d::`` operator: the reducer's all-reduces, buffer
broadcasts, barriers, ...) over the timed steps; the table gives them per step, by name,
for each system, and says whether the two agree. A stop signal's flag rides in the
reducer's agreement row and the snapshot is a local copy: a step with snapshots makes the
collectives a plain one makes.

Usage::

    python3 dev.py bench-collectives                  # every model
    python benchmarks/bench_elastic_collectives.py --models mlp convnet --steps 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from bench_harness import LR, MOMENTUM, run_ranks, timed_step
from models import MODELS

SYSTEMS = ("plain", "elastic")


def _step(model: Any, opt: torch.optim.Optimizer, job: Any, batch: Any) -> None:
    timed_step(model, opt, batch)
    if job is not None:
        job.step()


def count_collectives(
    rank: int, world_size: int, model_name: str, steps: int, root: str, run: str
) -> dict[str, dict[str, float]]:
    """On one rank: per system, the collectives per step by operator name."""
    from bench_elastic import elastic_env
    from bucketddp import BucketDataParallel
    from bucketddp.elastic import Elastic

    os.environ.update(elastic_env(rank, world_size, run, root))
    spec = MODELS[model_name]
    batch = spec.batch(seed=rank)
    out: dict[str, dict[str, float]] = {}
    for system in SYSTEMS:
        model = BucketDataParallel(spec.build(seed=0))
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        job = Elastic({"model": model, "optimizer": opt}) if system == "elastic" else None

        for _ in range(2):  # the first steps learn the order and take the first snapshot
            _step(model, opt, job, batch)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                _step(model, opt, job, batch)
        found = Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))
        out[system] = {name: n / steps for name, n in sorted(found.items())}
    return out  # the snapshot folders go with ``root``


def main(argv: list[str] | None = None) -> int:
    """Count on each model; print the table; exit 1 if a model's systems differ."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    p.add_argument("--steps", type=int, default=5, help="profiled steps per system")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    root = Path("/dev/shm") / f"bucketddp-bench-{uuid.uuid4().hex[:8]}"
    differ = []
    print(f"{'model':<17} {'system':<8} {'per step':>8}  by operator")
    try:
        for name in args.models:
            ranks: list[Any] = run_ranks(
                count_collectives,
                2,
                name,
                args.steps,
                str(root),
                f"count-{uuid.uuid4().hex[:8]}",
                timeout=120,
            )
            for system in SYSTEMS:
                found = ranks[0][system]
                ops = ", ".join(f"{op.removeprefix('c10d::')} {n:g}" for op, n in found.items())
                print(f"{name:<17} {system:<8} {sum(found.values()):>8g}  {ops}")
            if any(r["plain"] != r["elastic"] for r in ranks):
                differ.append(name)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("the same on every model" if not differ else f"different on {', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
