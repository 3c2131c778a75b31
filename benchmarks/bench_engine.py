"""Benchmark the engine: step time and peak memory of bucketddp against torch DDP on CPU/gloo.

Three systems train each model (see ``models.py``) with SGD and momentum:

- ``local``: the bare model, no communication: the floor the other two are measured against;
- ``torch_ddp``: ``torch.nn.parallel.DistributedDataParallel`` with its default options;
- ``bucketddp``: ``bucketddp.BucketDataParallel`` with its default options.

With ``--null``, a fourth: ``torch_ddp_b``, a second torch DDP, whose ratio to the first
shows how far apart two identical systems come out (the noise floor of the comparison).
Each ``--variant NAME:option=value[,...]`` adds a bucketddp with those engine options,
timed in the same rounds and compared with ``bucketddp``: what a feature costs, such as
``--variant bucketddp_finite:check_finite=True``.

Step times come from one pair of processes per model that keeps all systems alive and runs
them in interleaved rounds, in an order that changes every round (each system follows every
other equally often), so that slow drifts of the machine hit every system alike. Peak
memory comes from a fresh pair of processes per (model, system), because a process's peak
resident set size only ever grows.
See ``docs/benchmarks.md`` for how to read the output.

This file is the command line: arguments, tables and the JSON report. What runs on the
ranks is in ``bench_harness.py``; medians, ratios and intervals in ``bench_stats.py``.

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
    COMM_HOOKS,
    NULL_SYSTEM,
    RANKS_TIMEOUT,
    SYSTEMS,
    Config,
    Variant,
    loadavg,
    measure_model_memory,
    parse_variant,
    run_meta,
    run_ranks,
    time_model,
)
from bench_stats import pool_reports, summarize, verdict
from models import MODELS

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "engine.json"


# ------------------------------------------------------------------------- output
def _fmt_size(res: dict[str, Any]) -> str:
    """A model's parameters and parameter tensors, such as "0.93M, 54 tensors"."""
    n = res["params"]
    params = f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.0f}K"
    return f"{params}, {res['tensors']} tensors"


def _fmt_peak(mem: dict[str, Any] | None, local: dict[str, Any] | None) -> str:
    if mem is None:
        return "-"
    text = f"{mem['delta_mb']:+.0f}"
    if local is not None and mem is not local:
        text += f" ({mem['delta_mb'] - local['delta_mb']:+.0f})"
    return text


def print_time_table(
    title: str, results: dict[str, Any], memory: dict[str, Any], *, overhead: bool = False
) -> None:
    """One block per model: step time, spread, exposed communication and peak memory.

    ``overhead`` adds the bucketddp/local line, the figure of the world-size-1 section.
    """
    print(f"\n== {title}")
    width = max([10, *(len(s) for res in results.values() for s in res["systems"])])
    header = (
        f"{'model':<19} {'system':<{width}} {'step ms':>8} {'p25-p75 ms':>13} {'x local':>8} "
        f"{'exposed ms':>10} {'fwd':>6} {'bwd':>6} {'opt':>6} {'wait':>6} {'cpu':>6} "
        f"{'peak MB (vs local)':>19}"
    )
    print(header)
    print("-" * len(header))
    for name, res in results.items():
        figures = res["systems"]
        floor = figures.get("local", {}).get("median_ms")
        labels = [name, _fmt_size(res)]  # down the first column, beside the systems
        for i, (s, f) in enumerate(figures.items()):
            label = labels[i] if i < len(labels) else ""
            rel = f"{f['median_ms'] / floor:.3f}" if floor else "-"
            exposed = f"{f['exposed_comm_ms']:+.1f}" if "exposed_comm_ms" in f else "-"
            mem = memory.get(name, {}).get(s)
            peak = _fmt_peak(mem, memory.get(name, {}).get("local"))
            ours = s == "bucketddp" or s in res.get("variants", {})
            wait = f"{f['comm_wait_ms']:.1f}" if ours else "-"
            print(
                f"{label:<19} {s:<{width}} {f['median_ms']:8.1f} "
                f"{f['p25_ms']:6.1f}-{f['p75_ms']:<6.1f} {rel:>8} {exposed:>10} "
                f"{f['forward_ms']:6.1f} {f['backward_ms']:6.1f} {f['optimizer_ms']:6.1f} "
                f"{wait:>6} {f['cpu_ms']:6.1f} {peak:>19}"
            )
        if "ratio_of_medians" in res:
            ratios = res["round_ratios"]
            lo, hi = res["round_ratio_ci95"]
            print(
                f"{'':<19} bucketddp/torch_ddp: {res['ratio_of_medians']:.3f} (ratio of medians), "
                f"{res['median_round_ratio']:.3f} (median of {len(ratios)} round ratios, "
                f"range {min(ratios):.3f}-{max(ratios):.3f}); cpu {res['cpu_ratio']:.3f}"
            )
            print(
                f"{'':<19} 95% interval of the median round ratio: {lo:.3f}-{hi:.3f}, "
                f"{verdict((lo, hi))}"
            )
        for name, v in res.get("variants", {}).items():
            lo, hi = v["round_ratio_ci95"]
            print(
                f"{'':<19} {name}/bucketddp: {v['ratio_of_medians']:.3f} (ratio of medians), "
                f"{v['median_round_ratio']:.3f} (median of {len(v['round_ratios'])} round "
                f"ratios, 95% interval {lo:.3f}-{hi:.3f}, {verdict((lo, hi))}); "
                f"cpu {v['cpu_ratio']:.3f}"
            )
        if "null_ratio_of_medians" in res:
            lo, hi = res["null_round_ratio_ci95"]
            print(
                f"{'':<19} null, {NULL_SYSTEM}/torch_ddp: {res['null_ratio_of_medians']:.3f} "
                f"(ratio of medians), {res['null_median_round_ratio']:.3f} (median of round "
                f"ratios), 95% interval {lo:.3f}-{hi:.3f}"
            )
        if "bucketddp_bucket_mb" in res and not overhead:
            print(
                f"{'':<19} buckets (MB, launch order): bucketddp {res['bucketddp_bucket_mb']}, "
                f"torch_ddp {res.get('torch_ddp_bucket_mb') or 'unknown'}"
            )
        if overhead and "bucketddp_over_local" in res:
            print(
                f"{'':<19} bucketddp/local: {res['bucketddp_over_local']:.3f} (ratio of medians), "
                f"{res['bucketddp_over_local_rounds']:.3f} (median of round ratios)"
            )


def pool_main(paths: Sequence[Path]) -> int:
    """``--pool``: print the pooled bucketddp/torch_ddp ratios of earlier runs' JSON files."""
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
    print(f"bucketddp/torch_ddp pooled over {len(reports)} runs")
    for section, models in pooled.items():
        print(f"\n== {section.replace('_', ' ')}")
        for model, e in models.items():
            lo, hi = e["round_ratio_ci95"]
            per_run = ", ".join(f"{r:.3f}" for r in e["ratio_of_medians"])
            print(
                f"{model:<16} median of {len(e['round_ratios'])} round ratios "
                f"{e['median_round_ratio']:.3f}, 95% interval {lo:.3f}-{hi:.3f}, "
                f"{verdict((lo, hi))}; ratio of medians per run: {per_run}"
            )
            if "null_round_ratios" in e:
                lo, hi = e["null_round_ratio_ci95"]
                print(
                    f"{'':<16} null, {NULL_SYSTEM}/torch_ddp: median of "
                    f"{len(e['null_round_ratios'])} round ratios {e['null_median_round_ratio']:.3f}"
                    f", 95% interval {lo:.3f}-{hi:.3f} (from {len(e['null_ratio_of_medians'])} of "
                    f"the {e['runs']} runs)"
                )
    return 0


# ----------------------------------------------------------------------------- main
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
    p.add_argument("--batch-size", type=int, help="per-rank batch size (default: per model)")
    p.add_argument(
        "--world-size",
        type=int,
        nargs="+",
        choices=[1, 2],
        default=[2, 1],
        help="world sizes to time: 2 compares all three systems on every model, "
        "1 measures the wrapper's overhead over the bare model (default: 2 1)",
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
    p.add_argument("--quick", action="store_true", help="a smoke run: small rounds and steps")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"default: {DEFAULT_JSON}")
    p.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: pool the round ratios of earlier runs' JSON files and print them",
    )
    args = p.parse_args(argv)
    names = [name for name, _ in args.variant]
    if len(set(names)) < len(names):
        p.error(f"--variant names must differ, got {names}")
    defaults = {
        "rounds": (12, 2),
        "steps": (8, 3),
        "warmup": (2, 1),
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
    if min(counts) < 1 or args.warmup < 0:
        p.error(
            "--rounds, --steps, --memory-steps and --memory-repeats must be >= 1, --warmup >= 0"
        )
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
        },
    }
    print(
        f"bucketddp {bucketddp.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs"
        f"{f', {gpu}' if gpu else ''}, "
        f"load {report['meta']['loadavg_start']}; {cfg.rounds} rounds x ({cfg.warmup} warmup + "
        f"{cfg.steps} timed steps) per system"
    )
    if cfg.bucket_cap_mb is not None or cfg.first_bucket_mb is not None:
        print(
            f"bucket sizes: bucket_cap_mb {cfg.bucket_cap_mb or 'default'} (both wrappers), "
            f"first_bucket_mb {cfg.first_bucket_mb or cfg.bucket_cap_mb or 'default'} "
            "(bucketddp only)"
        )
    if cfg.comm_hook is not None:
        print(f"communication hook: {COMM_HOOKS[cfg.comm_hook].__name__} (both wrappers)")

    memory: dict[str, dict[str, Any]] = {}
    if 2 in args.world_size and not args.no_memory:
        for name in args.models:
            memory[name] = measure_model_memory(name, cfg, args.memory_repeats, backend)
            print(f"  memory {name}: done ({time.perf_counter() - started:.0f}s)", flush=True)
        report["memory_world_size_2"] = memory

    variants = tuple(name for name, _ in cfg.variants)
    timed = (*SYSTEMS, *variants, *([NULL_SYSTEM] if args.null else []))
    sections = [(2, args.models, timed), (1, args.ws1_models, (*SYSTEMS, *variants))]
    for world_size, names, systems in sections:
        if world_size not in args.world_size:
            continue
        results = {}
        for name in names:
            raw = run_ranks(
                time_model, world_size, name, systems, cfg, timeout=RANKS_TIMEOUT, backend=backend
            )[0]
            results[name] = summarize(raw, systems)
            print(
                f"  time {name} (world size {world_size}): done "
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
        f"\nstep ms: median of {cfg.rounds * cfg.steps} timed steps, each the max over ranks; "
        "exposed ms: step - local step;\n"
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
