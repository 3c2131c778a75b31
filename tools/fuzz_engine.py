#!/usr/bin/env python3
"""A seeded, randomized differential fuzzer for ``BucketDataParallel``: the runner.

Each *schedule* is a pure function of one integer seed (``fuzz_engine_schedule.py``): a
world size, a small model (``fuzz_engine_model.py``), engine options, and 2-5 training
steps. The schedule trains on real gloo ranks (``tools/multirank.py``), and every
rank's parameters and buffers after every step it trains, and at the end, are compared with
one process that trains the same model on the global batch (``fuzz_engine_reference.py``,
whose docstring says how it models gradients, buffers, SyncBatchNorm and checkpointing).

Usage (``python3 dev.py fuzz ...`` runs it in the project's venv)::

    .venv/bin/python tools/fuzz_engine.py --schedules 200 --seed 0
    .venv/bin/python tools/fuzz_engine.py --replay 17     # one schedule, described in full

It prints one line per schedule and exits non-zero if any fails, with the ``--replay``
command of each failing seed. The tolerance is ``ATOL``/``RTOL`` plus the rounding a
schedule amplifies (see ``compare``). Schedules of one world size share a launch,
``--group`` seeds at a time, since each rank process spends about two seconds importing
``torch._dynamo`` once; a launch that fails runs again one schedule at a time, so that the
failure names one seed. ``tests/distributed/test_fuzz.py`` runs a few seeds in the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import re
import sys
import time
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from bucketddp import BucketDataParallel
from bucketddp.reducer import storage
from bucketddp.syncbn import convert_sync_batchnorm
from fuzz_engine_model import (
    CUSTOM,
    LR,
    MOMENTUM,
    Opaque,
    batch,
    buffers_of,
    build_model,
    loss_of,
    params_of,
    rank_values,
    set_target,
)
from fuzz_engine_reference import reference
from fuzz_engine_schedule import WORLD_SIZES, Schedule, make_schedule
from multirank import run_ranks

RTOL = ATOL = 1e-5


def wrapper_options(s: Schedule) -> dict[str, Any]:
    """The keyword arguments of ``BucketDataParallel``: the options and the buffer policies."""
    kwargs = dict(s.options)
    if s.buffer_rules:
        kwargs["buffer_sync"] = {k: CUSTOM.get(p, p) for k, p in s.buffer_rules}
    if s.default_policy is not None:
        kwargs["default_buffer_policy"] = CUSTOM.get(s.default_policy, s.default_policy)
    return kwargs


def train_rank(rank: int, world: int, s: Schedule) -> dict[str, Any]:
    """Run the schedule through ``BucketDataParallel`` on this rank (a ``run_ranks`` target)."""
    # The fuzzer's models are small: let every bucket place its gradients in their slots
    # (reducer/prefill.py), which real models do from 16 small parameters a bucket on.
    storage.FEWEST_SMALL = 1
    model = build_model(s)
    model.ckpt, model.opaque = s.ckpt, s.opaque
    if s.syncbn:
        convert_sync_batchnorm(model)
    with torch.no_grad():
        for name, value in rank_values(buffers_of(model), rank).items():
            model.get_buffer(name).copy_(value)
    wrapped = BucketDataParallel(model, **wrapper_options(s))
    if s.hook:
        wrapped.register_comm_hook(None, allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    snapshots, buffer_snapshots = [], []
    # Only build the Join when it is used: torch's Join() switches its joinables' join
    # mode on as soon as it is constructed, entered or not.
    joined = wrapped.join(divide_by_initial_world_size=s.by_initial) if s.join else None
    with joined if joined is not None else contextlib.nullcontext():
        for i in range(s.batches[rank]):
            step = s.steps[i]
            set_target(model, s, step.target_trains)
            for m in range(step.micro):
                synced = m == step.micro - 1
                with contextlib.nullcontext() if synced else wrapped.no_sync():
                    x, tokens, y, labels = batch(s, i, m, rank)
                    out = wrapped(x, tokens, step.branch[m][rank], step.lookup[m][rank])
                    if isinstance(out, Opaque):
                        out = out.outputs
                    loss_of(out, y, labels).backward()
            opt.step()
            opt.zero_grad(set_to_none=step.set_to_none)
            snapshots.append(params_of(model))
            buffer_snapshots.append(buffers_of(model))
    return {
        "steps": snapshots,
        "step_buffers": buffer_snapshots,
        "params": params_of(model),
        "buffers": buffers_of(model),
    }


@dataclass
class Outcome:
    """The verdict on one schedule."""

    seed: int
    ok: bool
    error: float
    """The largest absolute difference from the reference."""
    seconds: float
    detail: str = ""
    """The first mismatches, or the failing rank's traceback."""


def compare(s: Schedule, ranks: Sequence[dict[str, Any]]) -> tuple[float, list[str]]:
    """The largest difference from the reference, and a line per tensor out of tolerance.

    Every rank's parameters and buffers after each step it trained, and its final
    parameters and buffers, must be within ``ATOL + RTOL * |reference|`` of the float32
    reference, plus four times the largest difference between the float32 and the float64
    reference in that tensor. The last term is float rounding, which an ill-conditioned
    schedule (a BatchNorm over a few samples) amplifies over the steps in any two float32
    runs; it is zero for most tensors.
    """
    want, exact = reference(s), reference(s, precise=True)
    worst, bad = 0.0, []

    def check(
        got: dict[str, torch.Tensor],
        ref: dict[str, torch.Tensor],
        ref64: dict[str, torch.Tensor],
        where: str,
    ) -> None:
        nonlocal worst
        if got.keys() != ref.keys():
            bad.append(f"{where}: names differ: {sorted(got.keys() ^ ref.keys())}")
            return
        for name, r in ref.items():
            g = got[name]
            if g.shape != r.shape or g.dtype != r.dtype:
                bad.append(f"{where} {name}: {g.dtype}{list(g.shape)} vs {r.dtype}{list(r.shape)}")
                continue
            g, r = g.double(), r.double()
            diff = (g - r).abs()
            if not diff.numel():
                continue
            noise = float((r - ref64[name].double()).abs().max())
            err = float(diff.max())
            worst = max(worst, err)
            if not bool((diff <= ATOL + RTOL * r.abs() + 4 * noise).all()):
                bad.append(f"{where} {name}: max abs error {err:.3g} (rounding {noise:.2g})")

    for rank, got in enumerate(ranks):
        for i, params in enumerate(got["steps"]):
            check(params, want["steps"][i], exact["steps"][i], f"rank {rank} after step {i}")
        for i, bufs in enumerate(got["step_buffers"]):
            where = f"rank {rank} buffers after step {i}"
            check(bufs, want["step_buffers"][i][rank], exact["step_buffers"][i][rank], where)
        check(got["params"], want["params"], exact["params"], f"rank {rank} final")
        where = f"rank {rank} final buffers"
        check(got["buffers"], want["buffers"][rank], exact["buffers"][rank], where)
    return worst, bad


def train_group(rank: int, world: int, schedules: Sequence[Schedule]) -> list[dict[str, Any]]:
    """``train_rank`` for several schedules in turn, in one process group.

    A rank process imports ``torch._dynamo`` (through ``torch.optim``) the first time it
    builds an optimizer, about two seconds: a group pays that once.
    """
    # Import it before the first timing, so that each schedule's time is its own.
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR)
    results = []
    for s in schedules:
        start = time.perf_counter()
        try:
            result = train_rank(rank, world, s)
        except Exception as err:
            raise RuntimeError(f"fuzz schedule {s.seed} raised on rank {rank}") from err
        result["seconds"] = time.perf_counter() - start
        results.append(result)
        gc.collect()  # the wrapper and its hooks go before the next schedule's
    return results


def run_group(schedules: Sequence[Schedule], timeout: float = 60.0) -> list[Outcome]:
    """Train schedules of one world size in one launch and judge each against its reference.

    If a rank raises or the launch times out, each schedule runs again in a launch of its
    own, so that the failure is pinned on one seed. Should every one of them pass alone,
    the failure depends on the schedules before it in the same processes: the seed the
    error names (or, after a hang, every seed of the group) fails, and says so.
    """
    world = schedules[0].world
    assert all(s.world == world for s in schedules)
    start = time.monotonic()
    try:
        # A schedule takes well under a second once the ranks have imported torch._dynamo.
        limit = timeout + 5.0 * (len(schedules) - 1)
        by_rank = run_ranks(train_group, world, list(schedules), timeout=limit)
    except Exception as err:  # a rank raised, died or hung
        text = str(err) or traceback.format_exc()
        if len(schedules) == 1:
            seconds = time.monotonic() - start
            return [Outcome(schedules[0].seed, False, float("nan"), seconds, text)]
        alone = [out for s in schedules for out in run_group([s], timeout)]
        if not all(out.ok for out in alone):
            return alone
        named = re.search(r"fuzz schedule (\d+) raised", text)
        blamed = {int(named.group(1))} if named else {s.seed for s in schedules}
        seeds = [s.seed for s in schedules]
        n = seeds[-1] - seeds[0] + 1
        note = (
            f"failed in one launch with seeds {seeds} (world size {world}) but passed alone, "
            "so it depends on the schedules run before it in the same processes; rerun "
            f"that launch with --seed {seeds[0]} --schedules {n} --group {n}:\n{text}"
        )
        for out in alone:
            if out.seed in blamed:
                out.ok, out.detail = False, note
        return alone
    outcomes = []
    for k, s in enumerate(schedules):
        ranks = [results[k] for results in by_rank]
        begin = time.monotonic()
        worst, bad = compare(s, ranks)
        seconds = max(r["seconds"] for r in ranks) + time.monotonic() - begin
        if len(schedules) == 1:
            seconds = time.monotonic() - start
        more = [f"... and {len(bad) - 8} more"] if len(bad) > 8 else []
        outcomes.append(Outcome(s.seed, not bad, worst, seconds, "\n".join(bad[:8] + more)))
    return outcomes


def run_seeds(
    seeds: Sequence[int],
    world_sizes: Sequence[int] = WORLD_SIZES,
    timeout: float = 60.0,
    group: int = 20,
) -> Iterator[tuple[Schedule, Outcome]]:
    """Generate and run the schedules of ``seeds``, ``group`` seeds at a time; yield in order."""
    for i in range(0, len(seeds), group):
        schedules = [make_schedule(seed, world_sizes) for seed in seeds[i : i + group]]
        outcomes: dict[int, Outcome] = {}
        for world in sorted({s.world for s in schedules}):
            for out in run_group([s for s in schedules if s.world == world], timeout):
                outcomes[out.seed] = out
        for s in schedules:
            yield s, outcomes[s.seed]


def _replay_command(seed: int, world_sizes: Sequence[int]) -> str:
    cmd = f"python3 dev.py fuzz --replay {seed}"
    if tuple(world_sizes) != WORLD_SIZES:
        cmd += f" --world-sizes {','.join(map(str, world_sizes))}"
    return cmd


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=50, help="schedules to run (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="the first schedule's seed (default 0)")
    parser.add_argument("--replay", type=int, help="run the one schedule of this seed, described")
    parser.add_argument(
        "--world-sizes",
        default=",".join(map(str, WORLD_SIZES)),
        help="comma-separated world sizes to draw from (default 2,3); part of a schedule",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per schedule")
    parser.add_argument(
        "--group", type=int, default=20, help="seeds per batch of launches (1: a launch each)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    world_sizes = tuple(int(w) for w in args.world_sizes.split(","))

    if args.replay is not None:
        s = make_schedule(args.replay, world_sizes)
        print(s.describe(), flush=True)
        [out] = run_group([s], args.timeout)
        verdict = "PASS" if out.ok else "FAIL"
        print(f"max abs error {out.error:.3g}, {out.seconds:.1f}s: {verdict}")
        if out.detail:
            print(out.detail)
        return 0 if out.ok else 1

    failed: list[Outcome] = []
    coverage: Counter[str] = Counter()
    start = time.monotonic()
    seeds = range(args.seed, args.seed + args.schedules)
    for s, out in run_seeds(seeds, world_sizes, args.timeout, max(1, args.group)):
        coverage.update(s.features())
        verdict = "PASS" if out.ok else "FAIL"
        print(f"{s.seed:6d}  {s.short():<88s} err {out.error:7.2g} {out.seconds:5.1f}s  {verdict}")
        if not out.ok:
            failed.append(out)
            print("        " + out.detail.replace("\n", "\n        "))
        sys.stdout.flush()
    took = time.monotonic() - start
    print(f"\n{args.schedules - len(failed)} of {args.schedules} schedules passed in {took:.0f}s")
    print("coverage: " + ", ".join(f"{k} {v}" for k, v in sorted(coverage.items())))
    for out in failed:
        print(f"FAILED seed {out.seed}: replay with {_replay_command(out.seed, world_sizes)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
