"""Benchmark elastic training: what snapshots cost per step, the shared memory they take, and
the time from a killed rank to the next completed step.

- **Step time** (the default run): on every benchmark model (``models.py``), 2 ranks (gloo,
  CPU, one thread each) train ``plain`` (``BucketDataParallel``) and the same with an
  ``Elastic`` helper taking a snapshot every 1, 2, 4 and 8 steps (``every1`` ...
  ``every8``), ``sync1``, a snapshot every step copied whole at the step's end (the
  optimizer's tensors not overlapped with the next step: ``overlap=False``, as before that
  overlap), and ``plain_b``, a second plain one whose ratio to the first is the noise
  floor. Each system has its own model, optimizer and snapshot folder, and all train in
  one pair of processes, in interleaved rounds whose order changes every round
  (``bench_harness.round_order``). A system's step time in a round is the mean over its
  timed steps, so that a snapshot every ``n`` steps is spread over them; it covers waiting
  for the round's last snapshot to be written, so that no background write spills into the
  next system's steps; and it is the slowest rank's. Reported per model: the median over
  rounds, and the median of the per-round ratios to ``plain`` with a bootstrap interval.
  The ranks get torchrun's environment variables by hand (a run id per run, attempt 0, one
  node) and ``BUCKETDDP_SNAPSHOT_DIR``, a fresh folder in /dev/shm removed at the end.
  Shared memory: the bytes of each snapshot folder (its two slots) after the rounds,
  against those of the model's and optimizer's state.
- ``--recovery``: real torchrun jobs training the benchmark MLP with a snapshot every step
  (``elastic_job.py``), in three scenarios: rank 1 of one agent's 2 workers SIGKILLs
  itself; one of two agents (one worker each, ``--nnodes=1:2``) is killed with its worker;
  the same with agents that notice a silent agent sooner (``keep_alive_interval=1``).
  Reported: the time from the kill to the first step the restarted workers complete, split
  at milestones (torchrun's restart, interpreter start, imports, group, set-up, restore,
  that step), median over runs (``bench_elastic_restarts.py``).
- ``--picture``: draws ``docs/images/elastic-run.png`` from the job that loses a node
  mid-epoch and goes on at world size 1, beside the same job uninterrupted: loss against
  step, the restart and the world size marked.
- ``--grow``: draws ``docs/images/elastic-grow.png`` the same way from a job that loses a
  node, and later gains one back (a third agent joins): 2 workers, then 1, then 2.

Usage (``python3 dev.py bench-elastic`` runs this file)::

    python benchmarks/bench_elastic.py               # step time and memory, ~15 min on 2 cores
    python benchmarks/bench_elastic.py --quick       # a smoke run
    python benchmarks/bench_elastic.py --recovery    # only the recovery runs (3 of each)
    python benchmarks/bench_elastic.py --picture     # only the picture
    python benchmarks/bench_elastic.py --grow        # only the shrink-then-grow picture
    python benchmarks/bench_elastic.py --pool a.json b.json   # earlier runs' rounds together
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import bucketddp
from bench_elastic_restarts import picture_main, print_recovery, recovery_main
from bench_harness import (
    LR,
    MOMENTUM,
    RANKS_TIMEOUT,
    add_run_options,
    loadavg,
    make_batches,
    round_order,
    run_meta,
    run_ranks,
    timed_step,
)
from bench_stats import bootstrap_ci, median, verdict
from bucketddp import BucketDataParallel
from bucketddp.elastic import Elastic
from bucketddp.skeleton import split_tensors
from models import MODELS

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "elastic.json"
PICTURE = HERE.parent / "docs" / "images" / "elastic-run.png"
GROW_PICTURE = HERE.parent / "docs" / "images" / "elastic-grow.png"
PLAIN, NULL, SYNC = "plain", "plain_b", "sync1"
TARGET = 1.05
PARTS = ("main", "thread", "wait")  # where a snapshot's time goes (timed_block)
"""The issue's target: at most 5% over plain."""


@dataclass(frozen=True)
class Config:
    """The knobs of one timing run, shipped to every rank."""

    rounds: int
    steps: int
    warmup: int
    every: tuple[int, ...]
    null: bool
    batch_size: int | None = None
    device: str = "cpu"  # for bench_harness.make_batches
    sync: bool = True  # also time SYNC: a snapshot every step, nothing copied during the next

    @property
    def systems(self) -> tuple[str, ...]:
        """Every system's name, plain first."""
        every = tuple(f"every{n}" for n in self.every)
        return (PLAIN, *([NULL] if self.null else []), *every, *([SYNC] if self.sync else []))

    @property
    def priming(self) -> int:
        """Untimed steps that take every system's first snapshots (a multiple of each
        ``every``, so that the rounds' timed steps take theirs at the same places)."""
        return math.lcm(*self.every)


def elastic_env(rank: int, world_size: int, run: str, root: str) -> dict[str, str]:
    """What torchrun would tell a worker of a one-node job, attempt 0."""
    return {
        "TORCHELASTIC_RUN_ID": run,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "GROUP_RANK": "0",
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "BUCKETDDP_SNAPSHOT_DIR": root,
    }


def written(job: Elastic | None) -> None:
    """Wait until every snapshot ``job`` has taken is written (its background thread)."""
    writer = None if job is None or job.session is None else job.session._writer
    if writer is not None:
        writer.wait()


def timed_block(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    job: Elastic | None,
    batches: Sequence[Any],
) -> dict[str, Any]:
    """Train one step per batch, each marked with ``job.step()``; wall and CPU seconds of the
    whole block (until its snapshots are written), each snapshot call's seconds, and where
    the snapshots' time went: the training thread's CPU in ``job.step()`` (``main``), the
    snapshot thread's CPU (``thread``) and the optimizer's waits for its copy (``wait``)."""
    calls = []
    main = 0.0
    thread0, wait0 = writer_times(job)
    c0, t0 = time.process_time(), time.perf_counter()
    for batch in batches:
        timed_step(model, optimizer, batch)
        if job is not None:
            s0, m0 = time.perf_counter(), time.thread_time()
            job.step()
            main += time.thread_time() - m0
            if job.session is not None and job.session.due(job.steps):
                calls.append(time.perf_counter() - s0)
    written(job)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    thread1, wait1 = writer_times(job)
    return {
        "wall": wall,
        "cpu": cpu,
        "calls": calls,
        "main": main,
        "thread": thread1 - thread0,
        "wait": wait1 - wait0,
    }


def writer_times(job: Elastic | None) -> tuple[float, float]:
    """The CPU seconds of ``job``'s snapshot thread so far, and its ``settle`` waits."""
    writer = None if job is None or job.session is None else job.session._writer
    ident = None if writer is None else writer._thread.ident
    if writer is None or ident is None or not writer._thread.is_alive():
        return 0.0, 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(ident)), writer.waited


def folder_bytes(path: Path) -> dict[str, int]:
    """The files in ``path``: their bytes, and the bytes shared memory holds for them."""
    files = [p.stat() for p in path.iterdir() if p.is_file()] if path.is_dir() else []
    return {
        "files": len(files),
        "bytes": sum(s.st_size for s in files),
        "allocated": sum(s.st_blocks * 512 for s in files),
    }


def time_snapshots(
    rank: int, world_size: int, model_name: str, cfg: Config, run: str, root: str
) -> dict[str, Any]:
    """On one rank: every system of ``cfg`` in interleaved rounds on one model."""
    os.environ.update(elastic_env(rank, world_size, run, root))
    spec = MODELS[model_name]
    systems: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, Elastic | None]] = {}
    for s in cfg.systems:
        model = BucketDataParallel(spec.build(seed=0))
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        job = None
        if s.startswith("every") or s == SYNC:
            every = 1 if s == SYNC else int(s.removeprefix("every"))
            state = {"model": model, "optimizer": opt}
            job = Elastic(state, every=every, overlap=s != SYNC)
            assert job.session is not None
            # A snapshot folder per system, as if each were a job of its own.
            job.session.job = dataclasses.replace(job.session.job, run_id=f"{run}-{s}")
        systems[s] = (model, opt, job)
    priming = make_batches(spec, cfg, rank, cfg.rounds, cfg.priming)
    for s in cfg.systems:
        timed_block(*systems[s], priming)
    per_round: dict[str, list[dict[str, Any]]] = {s: [] for s in cfg.systems}
    for r in range(cfg.rounds):
        batches = make_batches(spec, cfg, rank, r, cfg.warmup + cfg.steps)
        for s in round_order(cfg.systems, r):
            model, opt, job = systems[s]
            for batch in batches[: cfg.warmup]:
                timed_step(model, opt, batch)
            dist.barrier()
            per_round[s].append(timed_block(model, opt, job, batches[cfg.warmup :]))
    dist.barrier()
    model, opt, _ = systems[PLAIN]
    _, _, metas = split_tensors({"model": model.state_dict(), "optimizer": opt.state_dict()})
    shm: dict[str, Any] = {}
    if rank == 0:
        for s, (_, _, job) in systems.items():
            if job is not None and job.session is not None:
                shm[s] = folder_bytes(job.session.job.directory())
    for _, _, job in systems.values():
        if job is not None:
            job.finish()
    return {
        "per_round": per_round,
        "state_bytes": sum(m.nbytes for m in metas),
        "state_tensors": len(metas),
        "shm": shm,
    }


def summarize(ranks: Sequence[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    """One model's figures (``figures``) from what its ranks returned: per round, a
    system's step ms is the slowest rank's mean step, its CPU ms the ranks' mean."""
    rounds: dict[str, dict[str, list[float]]] = {}
    for s in cfg.systems:
        blocks = list(zip(*(r["per_round"][s] for r in ranks), strict=True))
        rounds[s] = {
            "round_step_ms": [1000 * max(b["wall"] for b in bs) / cfg.steps for bs in blocks],
            "round_cpu_ms": [
                1000 * sum(b["cpu"] for b in bs) / len(bs) / cfg.steps for bs in blocks
            ],
            "snapshot_calls_ms": [1000 * c for bs in blocks for b in bs for c in b["calls"]],
            **{
                f"round_{part}_ms": [
                    1000 * sum(b.get(part, 0.0) for b in bs) / len(bs) / cfg.steps for bs in blocks
                ]
                for part in PARTS
            },
        }
    state = {key: ranks[0][key] for key in ("state_bytes", "state_tensors", "shm")}
    return figures(rounds, state, cfg.every)


def figures(
    rounds: dict[str, dict[str, list[float]]], state: dict[str, Any], every: Sequence[int]
) -> dict[str, Any]:
    """Per system: step and CPU ms (medians over rounds) and the median snapshot call; per
    system but plain: the median of the per-round ratios to plain, with 95% intervals.
    ``rounds`` may pool several runs' rounds, in the same order for every system."""
    out: dict[str, Any] = {"systems": {}, **state}
    plain = rounds[PLAIN]
    for s, r in rounds.items():
        calls = r["snapshot_calls_ms"]
        f = out["systems"][s] = {
            **r,
            "step_ms": median(r["round_step_ms"]),
            "cpu_ms": median(r["round_cpu_ms"]),
            "snapshot_call_ms": median(calls) if calls else None,
            **{f"{part}_ms": median(r.get(f"round_{part}_ms", [0.0])) for part in PARTS},
        }
        if s == PLAIN:
            continue
        wall = [a / b for a, b in zip(r["round_step_ms"], plain["round_step_ms"], strict=True)]
        cpu = [a / b for a, b in zip(r["round_cpu_ms"], plain["round_cpu_ms"], strict=True)]
        ci = bootstrap_ci(wall)
        f.update(
            ratio=median(wall),
            ratio_ci95=list(ci),
            verdict=verdict(ci),
            cpu_ratio=median(cpu),
            cpu_ratio_ci95=list(bootstrap_ci(cpu)),
        )
    for s, used in state["shm"].items():
        out["systems"][s]["shm"] = {**used, "x_state": used["allocated"] / state["state_bytes"]}
    under = [n for n in every if out["systems"][f"every{n}"]["ratio"] <= TARGET]
    out["every_under_target"] = min(under) if under else None
    return out


def pool(reports: Sequence[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], Config]:
    """``--pool``: every model's rounds of several runs' reports, as one run's figures.

    Raises ValueError, naming the file, for a report of other steps, warm-up or systems.
    """
    keys = ("steps", "warmup", "every", "null", "sync")
    first_name, first = reports[0]
    pooled: dict[str, dict[str, dict[str, list[float]]]] = {}
    state: dict[str, dict[str, Any]] = {}
    for name, report in reports:
        config = report.get("config", {})
        for key in keys:
            if config.get(key) != first["config"].get(key):
                raise ValueError(
                    f"{name}: {key} is {config.get(key)!r}, but {first['config'].get(key)!r} in "
                    f"{first_name}; pool only runs made with the same options"
                )
        for model, res in report.get("world_size_2", {}).items():
            state.setdefault(model, {k: res[k] for k in ("state_bytes", "state_tensors")})
            state[model].setdefault(
                "shm", {s: f["shm"] for s, f in res["systems"].items() if "shm" in f}
            )
            for s, f in res["systems"].items():
                mine = pooled.setdefault(model, {}).setdefault(s, {})
                parts = [f"round_{part}_ms" for part in PARTS if f"round_{part}_ms" in f]
                for key in ("round_step_ms", "round_cpu_ms", "snapshot_calls_ms", *parts):
                    mine.setdefault(key, []).extend(f[key])
    c = first["config"]
    cfg = Config(
        c["rounds"],
        c["steps"],
        c["warmup"],
        tuple(c["every"]),
        c["null"],
        sync=c.get("sync", False),
    )
    return {m: figures(r, state[m], cfg.every) for m, r in pooled.items()}, cfg


def print_table(results: dict[str, Any], cfg: Config) -> None:
    """One block per model: step ms, ratio to plain with its interval, CPU, snapshot, shm."""
    header = (
        f"{'model':<17} {'system':<8} {'step ms':>8} {'x plain':>7} {'95% interval':>13} "
        f"{'verdict':>12} {'cpu x':>6} {'95% interval':>13} {'snap ms':>8} {'shm MB':>7} "
        f"{'x state':>7}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for name, res in results.items():
        labels = [name, f"state {res['state_bytes'] / 2**20:.1f} MB"]
        for i, (s, f) in enumerate(res["systems"].items()):
            label = labels[i] if i < len(labels) else ""
            ratio = f"{f['ratio']:.3f}" if "ratio" in f else "-"
            ci = "{:.3f}-{:.3f}".format(*f["ratio_ci95"]) if "ratio" in f else "-"
            cpu = f"{f['cpu_ratio']:.3f}" if "cpu_ratio" in f else "-"
            cpu_ci = "{:.3f}-{:.3f}".format(*f["cpu_ratio_ci95"]) if "cpu_ratio" in f else "-"
            snap = f"{f['snapshot_call_ms']:.1f}" if f["snapshot_call_ms"] is not None else "-"
            shm = f.get("shm")
            mb = f"{shm['allocated'] / 2**20:.1f}" if shm else "-"
            x_state = f"{shm['x_state']:.2f}" if shm else "-"
            print(
                f"{label:<17} {s:<8} {f['step_ms']:>8.1f} {ratio:>7} {ci:>13} "
                f"{f.get('verdict', '-'):>12} {cpu:>6} {cpu_ci:>13} {snap:>8} {mb:>7} "
                f"{x_state:>7}"
            )
        every = res["every_under_target"]
        print(f"{'':<17} under {TARGET - 1:.0%}: every {every if every else 'none'}")
    print_parts(results)
    print(
        f"\nstep ms: mean of a round's {cfg.steps} timed steps (with their snapshots and the "
        "wait for the last one's write), slowest rank, median over rounds;\nx plain: median "
        "of the per-round ratios to plain, with a bootstrap 95% interval (plain_b: the noise "
        "floor);\ncpu x: the same ratio of CPU time per step (all threads, mean over ranks; "
        "steadier than step ms on a busy machine, blind to waits); "
        "snap ms: median time of an Elastic.step() call that took a snapshot;\nshm MB: the "
        "system's snapshot folder (two slots, both ranks); x state: that over the bytes of "
        "model and optimizer state"
    )


def print_parts(results: dict[str, Any]) -> None:
    """Where a snapshot every step spends its time, per model: ms per step and rank."""
    header = (
        f"{'model':<17} {'system':<8} {'plain cpu':>9} {'main':>6} {'thread':>7} {'wait':>6} "
        f"{'cpu floor':>9}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for name, res in results.items():
        plain = res["systems"][PLAIN]["cpu_ms"]
        for s in (f"every{1}", SYNC):
            f = res["systems"].get(s)
            if f is None or "main_ms" not in f:
                continue
            floor = 1 + (f["main_ms"] + f["thread_ms"]) / plain
            print(
                f"{name:<17} {s:<8} {plain:>9.2f} {f['main_ms']:>6.2f} {f['thread_ms']:>7.2f} "
                f"{f['wait_ms']:>6.2f} {floor:>9.3f}"
            )
    print(
        "\nms per step and rank, medians over rounds. plain cpu: the training's CPU without "
        "snapshots; main: the training thread's CPU in Elastic.step() (the state dicts, the "
        "skeleton, the own part, the copy of what is not overlapped); thread: the snapshot "
        "thread's CPU (the overlapped copy, the checksum, the meta); wait: the optimizer's "
        "waits for that copy. cpu floor: 1 + (main + thread) / plain cpu, the step-time ratio "
        "to expect where the cores are all busy (2 ranks on 2 cores)"
    )


# ----------------------------------------------------------------- command line
def pool_main(paths: Sequence[Path]) -> int:
    """``--pool``: print the table of earlier runs' rounds together."""
    try:
        reports = [(str(p), json.loads(p.read_text())) for p in paths]
        results, cfg = pool(reports)
    except (OSError, ValueError, KeyError) as err:  # JSONDecodeError is a ValueError
        print(f"bench_elastic: cannot pool {[str(p) for p in paths]}: {err!r}", file=sys.stderr)
        return 2
    loads = [r["meta"].get(k) for _, r in reports for k in ("loadavg_start", "loadavg_end")]
    print(f"{len(reports)} runs pooled; load averages at their starts and ends: {loads}")
    print_table(results, cfg)
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``--quick`` fills in small values for the options left unset."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--every", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 24; quick 2)")
    p.add_argument(
        "--steps",
        type=int,
        help="timed steps per system and round, a multiple of every --every (default 8)",
    )
    p.add_argument("--warmup", type=int, help="untimed steps before them (default 2; quick 1)")
    p.add_argument("--batch-size", type=int, help="per-rank batch size (default: per model)")
    p.add_argument("--no-null", action="store_true", help=f"do not time {NULL}")
    p.add_argument(
        "--no-sync", action="store_true", help=f"do not time {SYNC} (every step, no overlap)"
    )
    p.add_argument("--recovery", action="store_true", help="only the recovery runs")
    p.add_argument("--recovery-runs", type=int, default=3)
    p.add_argument("--picture", action="store_true", help=f"only draw {PICTURE.name}")
    p.add_argument(
        "--grow",
        action="store_true",
        help=f"only draw {GROW_PICTURE.name} (a node lost, then one joins)",
    )
    p.add_argument(
        "--image", type=Path, help=f"where to draw (default {PICTURE.name} or {GROW_PICTURE.name})"
    )
    add_run_options(
        p, DEFAULT_JSON, "pool the rounds of earlier runs' JSON files and print the table"
    )
    args = p.parse_args(argv)
    for key, (full, quick) in {"rounds": (24, 2), "warmup": (2, 1)}.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.steps is None:
        args.steps = max(8, math.lcm(*args.every))
    if min(args.every) < 1 or args.steps % math.lcm(*args.every):
        p.error(f"--every must be positive and --steps a multiple of each, got {args.every}")
    if args.rounds < 1 or args.warmup < 0 or args.recovery_runs < 1:
        p.error("--rounds and --recovery-runs must be >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run what the arguments ask for, print the tables and write the JSON."""
    args = parse_args(argv)
    if args.pool:
        return pool_main(args.pool)
    cfg = Config(
        args.rounds,
        args.steps,
        args.warmup,
        tuple(args.every),
        not args.no_null,
        args.batch_size,
        sync=not args.no_sync,
    )
    started = time.perf_counter()
    report: dict[str, Any] = {
        "meta": run_meta(loadavg_start=loadavg()),
        "config": {**dataclasses.asdict(cfg), "models": args.models},
    }
    print(
        f"bucketddp {bucketddp.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"load {report['meta']['loadavg_start']}"
    )
    shm_root = Path("/dev/shm") / f"bucketddp-bench-{uuid.uuid4().hex[:8]}"
    results_dir = args.json.parent
    results_dir.mkdir(parents=True, exist_ok=True)
    try:
        if args.picture or args.grow:
            image = args.image or (GROW_PICTURE if args.grow else PICTURE)
            report["picture"] = picture_main(shm_root, results_dir, image, grow=args.grow)
        elif args.recovery:
            report["recovery"] = recovery_main(args.recovery_runs, shm_root, results_dir)
            print_recovery(report["recovery"])
        else:
            print(
                f"{cfg.rounds} rounds x ({cfg.warmup} warmup + {cfg.steps} timed steps) per "
                f"system, systems {', '.join(cfg.systems)}"
            )
            results = {}
            for name in args.models:
                run = f"bench-{uuid.uuid4().hex[:8]}"
                ranks = run_ranks(
                    time_snapshots, 2, name, cfg, run, str(shm_root), timeout=RANKS_TIMEOUT
                )
                results[name] = summarize(ranks, cfg)
                print(f"  {name}: done ({time.perf_counter() - started:.0f}s)", flush=True)
            report["world_size_2"] = results
            print_table(results, cfg)
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
    report["meta"]["loadavg_end"] = loadavg()
    report["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    print(
        f"load average {report['meta']['loadavg_start']} -> {report['meta']['loadavg_end']}; "
        f"{report['meta']['seconds']:.0f}s in all"
    )
    json_path = args.json
    if args.picture or args.grow or args.recovery:
        kind = "grow" if args.grow else "picture" if args.picture else "recovery"
        json_path = json_path.with_name(f"{json_path.stem}-{kind}.json")
    json_path.write_text(json.dumps(report, indent=1))
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
