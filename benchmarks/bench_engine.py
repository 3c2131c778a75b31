"""Benchmark the engine: step time and peak memory of bucketddp against torch DDP on CPU/gloo.

Three systems train each model (see ``models.py``) with SGD and momentum:

- ``local``: the bare model, no communication: the floor the other two are measured against;
- ``torch_ddp``: ``torch.nn.parallel.DistributedDataParallel`` with its default options;
- ``bucketddp``: ``bucketddp.BucketDataParallel`` with its default options.

At world size 2 the rounds also time ``allreduce``: one all-reduce of a tensor as large as
the model's gradients. The floor of a step is ``local`` plus that; each system's step minus
the floor is its overhead beyond the wire.

With ``--null``, another system: ``torch_ddp_b``, a second torch DDP, whose ratio to the
first shows how far apart two identical systems come out (the noise floor of the
comparison). Each ``--variant NAME:option=value[,...]`` adds a bucketddp with those engine
options, timed in the same rounds and compared with ``bucketddp`` and torch DDP: what a
feature costs, such as ``--variant bucketddp_finite:check_finite=True``. ``--overheads``
adds the variants that measure telemetry, the watchdog, the finite check and ``"auto"``
bucket sizes.

Step times come from one pair of processes per model that keeps all systems alive and runs
them in interleaved rounds, in an order that changes every round (each system follows every
other equally often), so that slow drifts of the machine hit every system alike. Peak
memory comes from a fresh pair of processes per (model, system), because a process's peak
resident set size only ever grows.
See ``docs/benchmarks.md`` for how to read the output.

This file is the command line and the JSON report. What runs on the ranks is in
``bench_harness.py`` and ``bench_memory.py``; medians, ratios and intervals in
``bench_stats.py``; the printed tables in ``bench_report.py``.

Usage::

    python benchmarks/bench_engine.py            # the full run, a few minutes on 2 cores
    python benchmarks/bench_engine.py --quick    # a smoke run, under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import bucketddp
from bench_harness import (
    ALLREDUCE,
    COMM_HOOKS,
    NULL_SYSTEM,
    RANKS_TIMEOUT,
    SYSTEMS,
    Config,
    Variant,
    add_run_options,
    hooked_systems,
    loadavg,
    parse_variant,
    run_meta,
    run_ranks,
    time_model,
)
from bench_memory import measure_model_memory
from bench_report import print_pooled, print_time_table
from bench_stats import pool_reports, summarize
from models import MODELS

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "engine.json"
OVERHEADS = (
    "bucketddp_no_telemetry:telemetry=False",
    "bucketddp_no_watchdog:watchdog=False",
    "bucketddp_finite:check_finite=True",
    "bucketddp_auto:bucket_cap_mb=auto",
)
"""The variants ``--overheads`` adds: what telemetry, the watchdog and the finite check
cost, and ``"auto"`` bucket sizes against the default and torch DDP."""


def pool_main(paths: Sequence[Path]) -> int:
    """``--pool``: print the pooled ratios of earlier runs' JSON files."""
    reports = []
    for path in paths:
        try:
            reports.append((str(path), json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as err:
            print(f"bench_engine: cannot read {path}: {err}", file=sys.stderr)
            return 2
    try:
        pooled = pool_reports(reports)
    except ValueError as err:
        print(f"bench_engine: {err}", file=sys.stderr)
        return 2
    print_pooled(pooled, len(reports))
    return 0


def _variant(text: str) -> Variant:
    """``--variant``'s argument, or argparse's error naming what is wrong with it."""
    try:
        return parse_variant(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``--quick`` fills in small values for the options left unset."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 12; quick 2)")
    p.add_argument(
        "--steps", type=int, help="timed steps per system and round (default 8; quick 3)"
    )
    p.add_argument("--warmup", type=int, help="untimed steps before them (default 2; quick 1)")
    p.add_argument(
        "--min-round-ms",
        type=float,
        help="time at least this long per system and round: a model whose steps are "
        "shorter gets more timed steps per round than --steps, up to 16 times as many, "
        "so that its round medians hold still (default 200; quick 0; 0 times --steps on "
        "every model)",
    )
    p.add_argument("--batch-size", type=int, help="per-rank batch size (default: per model)")
    p.add_argument(
        "--world-size",
        type=int,
        nargs="+",
        default=[2, 1],
        help="world sizes to time: 2 or more compares all three systems on every model "
        "(memory is measured at 2), 1 measures the wrapper's overhead over the bare model "
        "(default: 2 1)",
    )
    p.add_argument(
        "--ws1-models",
        nargs="+",
        choices=list(MODELS),
        default=["mlp"],
        help="models for the world-size-1 section (default: mlp)",
    )
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        help="bucket_cap_mb of both torch DDP and bucketddp (default: theirs, 25); torch DDP "
        "then makes its first bucket this size too, and so does bucketddp unless "
        "--first-bucket-mb is given",
    )
    p.add_argument(
        "--first-bucket-mb",
        type=float,
        help="bucketddp's first_bucket_mb (default: torch DDP's first bucket, 1 MB, or "
        "--bucket-cap-mb if given)",
    )
    p.add_argument(
        "--comm-hook",
        choices=list(COMM_HOOKS),
        help="a communication hook of torch's, registered on both wrappers (default: none)",
    )
    p.add_argument(
        "--hooks",
        nargs="*",
        choices=list(COMM_HOOKS),
        default=list(COMM_HOOKS),
        help="at world size 2, also time torch DDP and bucketddp with each of these hooks, "
        "as systems of their own in the same rounds, such as bucketddp+fp16 (default: "
        f"{' '.join(COMM_HOOKS)}; none without a value)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: gloo (default); cuda: NCCL, one GPU per rank, so world size 2 needs 2 GPUs",
    )
    p.add_argument(
        "--null",
        action="store_true",
        help=f"also time {NULL_SYSTEM}, a second torch DDP, at world size 2: its ratio to "
        "torch_ddp is the noise floor of the comparison",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        type=_variant,
        metavar="NAME:OPTION=VALUE[,...]",
        help="also time a bucketddp with these engine options, compared with bucketddp, "
        "such as bucketddp_finite:check_finite=True (repeatable; values are Python "
        "literals; timing only, no memory runs)",
    )
    p.add_argument(
        "--overheads",
        action="store_true",
        help="add the variants " + ", ".join(OVERHEADS) + " (see --variant)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    p.add_argument(
        "--malloc-mmap-kb",
        type=int,
        metavar="KB",
        help="CPU memory runs only: have glibc map every allocation of KB KiB or more on its "
        "own and return it when freed, so that peak RSS follows the memory in use instead "
        "of the allocator's reuse (64 is a good value; Linux with glibc)",
    )
    p.add_argument("--memory-steps", type=int, help="steps per memory run (default 4; quick 2)")
    p.add_argument(
        "--memory-repeats",
        type=int,
        help="fresh process pairs per system and model for peak memory; the median is "
        "reported (default 3; quick 1)",
    )
    add_run_options(
        p, DEFAULT_JSON, "pool the round ratios of earlier runs' JSON files and print them"
    )
    args = p.parse_args(argv)
    if args.overheads:
        args.variant += [parse_variant(text) for text in OVERHEADS]
    names = [name for name, _ in args.variant]
    if len(set(names)) < len(names):
        p.error(f"--variant names must differ, got {names}")
    defaults = {
        "rounds": (12, 2),
        "steps": (8, 3),
        "warmup": (2, 1),
        "min_round_ms": (200.0, 0.0),
        "memory_steps": (4, 2),
        "memory_repeats": (3, 1),
    }
    for key, (full, quick) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    if args.malloc_mmap_kb is not None:
        if args.malloc_mmap_kb < 1:
            p.error(f"--malloc-mmap-kb must be at least 1, got {args.malloc_mmap_kb}")
        if args.device == "cuda":
            p.error("--malloc-mmap-kb tunes the CPU allocator; --device cuda measures GPU memory")
    counts = (args.rounds, args.steps, args.memory_steps, args.memory_repeats)
    if min(counts) < 1 or args.warmup < 0 or not args.min_round_ms >= 0:
        p.error(
            "--rounds, --steps, --memory-steps and --memory-repeats must be >= 1, --warmup "
            "and --min-round-ms >= 0"
        )
    if min(args.world_size) < 1:
        p.error(f"--world-size values must be >= 1, got {args.world_size}")
    for opt in ("bucket_cap_mb", "first_bucket_mb"):
        value = getattr(args, opt)
        if value is not None and not value > 0:
            p.error(f"--{opt.replace('_', '-')} must be positive, got {value}")
    if args.device == "cuda" and not args.pool:
        gpus = torch.cuda.device_count()
        if gpus == 0:
            p.error("--device cuda: torch sees no CUDA GPU here")
        if max(args.world_size) > gpus:
            p.error(
                f"--device cuda runs one NCCL rank per GPU and this machine has {gpus}: "
                f"pass --world-size {' '.join(str(w) for w in args.world_size if w <= gpus) or 1}"
            )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sections the arguments ask for, print the tables and write the JSON."""
    args = parse_args(argv)
    if args.pool:
        return pool_main(args.pool)
    cfg = Config(
        args.rounds,
        args.steps,
        args.warmup,
        args.batch_size,
        args.memory_steps,
        args.bucket_cap_mb,
        args.first_bucket_mb,
        args.comm_hook,
        args.device,
        args.malloc_mmap_kb,
        tuple(args.variant),
        args.min_round_ms,
    )
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    gpu = torch.cuda.get_device_name(0) if cfg.device == "cuda" else None
    started = time.perf_counter()
    report: dict[str, Any] = {
        "meta": run_meta(loadavg_start=loadavg(), backend=backend, device=cfg.device, gpu=gpu),
        "config": {
            **asdict(cfg),
            "models": args.models,
            "world_sizes": args.world_size,
            "memory_repeats": args.memory_repeats,
            "null": args.null,
            "overheads": args.overheads,
            "hooks": args.hooks,
            "interleaved": "steps",
        },
    }
    print(
        f"bucketddp {bucketddp.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs"
        f"{f', {gpu}' if gpu else ''}, "
        f"load {report['meta']['loadavg_start']}; {cfg.rounds} rounds x ({cfg.warmup} warmup + "
        f"{cfg.steps} timed steps) per system"
        + (
            f", more steps for a model whose {cfg.steps} take under {cfg.min_round_ms:g} ms"
            if cfg.min_round_ms
            else ""
        )
    )
    if cfg.bucket_cap_mb is not None or cfg.first_bucket_mb is not None:
        print(
            f"bucket sizes: bucket_cap_mb {cfg.bucket_cap_mb or 'default'} (both wrappers), "
            f"first_bucket_mb {cfg.first_bucket_mb or cfg.bucket_cap_mb or 'default'} "
            "(bucketddp only)"
        )
    if cfg.comm_hook is not None:
        print(f"communication hook: {cfg.comm_hook} (both wrappers)")

    memory: dict[str, dict[str, Any]] = {}
    if 2 in args.world_size and not args.no_memory:
        for name in args.models:
            memory[name] = measure_model_memory(name, cfg, args.memory_repeats, backend)
            print(f"  memory {name}: done ({time.perf_counter() - started:.0f}s)", flush=True)
        report["memory_world_size_2"] = memory

    variants = tuple(name for name, _ in cfg.variants)
    hooked = tuple(hooked_systems(args.hooks))
    timed = (*SYSTEMS, ALLREDUCE, *hooked, *variants, *([NULL_SYSTEM] if args.null else []))
    sections = [(n, args.models, timed) for n in args.world_size if n >= 2]
    if 1 in args.world_size:
        sections.append((1, args.ws1_models, (*SYSTEMS, *variants)))
    for world_size, names, systems in sections:
        results = {}
        for name in names:
            raw = run_ranks(
                time_model, world_size, name, systems, cfg, timeout=RANKS_TIMEOUT, backend=backend
            )[0]
            results[name] = summarize(raw, systems)
            print(
                f"  time {name} (world size {world_size}, {raw['steps_per_round']} timed steps "
                "per round): done "
                f"({time.perf_counter() - started:.0f}s)",
                flush=True,
            )
        report[f"world_size_{world_size}"] = results
        mem = memory if world_size == 2 else {}
        print_time_table(
            f"world size {world_size}, {backend} on {cfg.device.upper()}, 1 thread per rank",
            results,
            mem,
            overhead=world_size == 1,
        )

    report["meta"]["loadavg_end"] = loadavg()
    report["meta"]["seconds"] = round(time.perf_counter() - started, 1)
    print(
        f"\nstep ms: median of the {cfg.rounds} rounds' timed steps, each the max over ranks; "
        "exposed ms: step - local step;\n"
        "allreduce: one all-reduce of the gradients' bytes in one tensor (the wire); "
        "beyond the wire: step - local - allreduce;\n"
        "fwd/bwd/opt: median phase times, mean over ranks; "
        "wait: bucketddp's comm_stats.wait_seconds;\n"
        "cpu: CPU time per step of a rank's process, all threads (median, mean over ranks); "
        "less sensitive than step ms to other load on the machine;\n"
        f"peak MB: peak {'GPU memory allocated' if gpu else 'RSS'} growth over the built "
        "model (fresh process pairs, max over ranks, median over pairs), "
        "in brackets its difference to local"
        + (
            f"; glibc maps allocations of {cfg.malloc_mmap_kb} KiB and up on their own"
            if cfg.malloc_mmap_kb is not None
            else ""
        )
    )
    print(
        f"load average {report['meta']['loadavg_start']} -> {report['meta']['loadavg_end']}; "
        f"{report['meta']['seconds']:.0f}s in all"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
