"""The pictures in docs/: a bucket-size sweep, and one step's overlap on two ranks.

- ``docs/images/bucket-sweep.png``: for every benchmark model, bucketddp's step time and
  exposed wait (``comm_stats.wait_seconds``) against ``bucket_cap_mb`` (with
  ``first_bucket_mb`` the same, so every bucket has that cap), timed like
  ``bench_engine.py`` (interleaved rounds, 2 gloo ranks, medians), beside torch DDP,
  bucketddp's defaults, ``"auto"`` and the floor (no-communication step plus one all-reduce
  of the gradients).
- ``docs/images/overlap-timeline.png``: one step of one model on both ranks, from
  ``comm_stats.bucket_timings``: forward, backward, each bucket's ready mark and all-reduce,
  the end-of-backward wait, and the optimizer.

Usage (a few minutes on 2 cores; close other work first)::

    .venv/bin/python benchmarks/bench_plots.py            # measure, then draw
    .venv/bin/python benchmarks/bench_plots.py --replot   # draw again from the saved JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from bench_harness import (
    ALLREDUCE,
    LR,
    MOMENTUM,
    RANKS_TIMEOUT,
    Config,
    loadavg,
    make_batches,
    run_meta,
    run_ranks,
    time_model,
    timed_step,
)
from bench_stats import median, quantile, summarize
from bucketddp import BucketDataParallel
from bucketddp.buckets import ParamInfo, cap_bytes, plan_buckets
from models import MODELS

HERE = Path(__file__).resolve().parent
IMAGES = HERE.parent / "docs" / "images"
DEFAULT_JSON = HERE / "results" / "plots.json"
GRID_MB = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
FIXED = ("local", ALLREDUCE, "torch_ddp", "bucketddp", "auto")


# ------------------------------------------------------------------------ measuring
def sweep_caps(model_name: str) -> list[float]:
    """The sizes of ``GRID_MB`` that give distinct buckets, up to one bucket for all."""
    model = MODELS[model_name].build(seed=0)
    params = [
        ParamInfo(n, p.numel(), p.dtype, p.device)
        for n, p in model.named_parameters()
        if p.requires_grad
    ]
    caps, seen = [], set()
    for cap in GRID_MB:
        plan = plan_buckets(params, cap_bytes=cap_bytes(cap), first_cap_bytes=cap_bytes(cap))
        key = tuple(b.names for b in plan)
        if key not in seen:
            seen.add(key)
            caps.append(cap)
        if len(plan) == 1:
            break
    return caps


def measure_sweep(model_name: str, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    """Step time and wait of bucketddp at each cap, and of the reference systems."""
    caps = sweep_caps(model_name)
    names = [f"cap{i}" for i in range(len(caps))]
    variants = [
        (n, (("bucket_cap_mb", c), ("first_bucket_mb", c)))
        for n, c in zip(names, caps, strict=True)
    ]
    variants.append(("auto", (("bucket_cap_mb", "auto"),)))
    cfg = Config(rounds, steps, warmup, None, 1, variants=tuple(variants))
    systems = (*FIXED, *names)
    raw = run_ranks(time_model, 2, model_name, systems, cfg, timeout=RANKS_TIMEOUT)[0]
    res = summarize(raw, systems)
    figures = res["systems"]

    def point(s: str) -> dict[str, Any]:
        f = figures[s]
        return {k: f[k] for k in ("median_ms", "round_medians_ms", "comm_wait_ms")}

    return {
        "gradient_mb": res["gradient_mb"],
        "caps": caps,
        "sweep": [point(n) for n in names],
        "reference": {s: point(s) for s in FIXED},
        "auto_choice": res["variants"]["auto"]["tuning"],
    }


def record_steps(
    rank: int, world_size: int, model_name: str, options: dict[str, Any], warmup: int, steps: int
) -> list[dict[str, Any]]:
    """Train bucketddp and keep each step's phase times and bucket timings (perf_counter s)."""
    spec = MODELS[model_name]
    model = BucketDataParallel(spec.build(seed=0), **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    batches = make_batches(spec, Config(1, steps, warmup, None, 1), rank, 0, warmup + steps)
    out = []
    for batch in batches:
        t0, t1, t2, t3 = timed_step(model, optimizer, batch)
        stats = model.comm_stats
        out.append(
            {
                "forward": t0,
                "backward": t1,
                "backward_end": t2,
                "end": t3,
                "wait_started": stats.wait_started,
                "wait_seconds": stats.wait_seconds,
                "buckets": [dataclasses.asdict(t) for t in stats.bucket_timings],
            }
        )
    return out[warmup:]


def measure_timeline(model_name: str, cap_mb: float | None) -> dict[str, Any]:
    """One typical step on both ranks: the step whose time (max over ranks) is the median."""
    options = {} if cap_mb is None else {"bucket_cap_mb": cap_mb, "first_bucket_mb": cap_mb}
    ranks = run_ranks(record_steps, 2, model_name, options, 6, 9, timeout=RANKS_TIMEOUT)
    lengths = [
        max(r[i]["end"] for r in ranks) - min(r[i]["forward"] for r in ranks) for i in range(9)
    ]
    pick = lengths.index(statistics.median_low(lengths))
    return {"model": model_name, "cap_mb": cap_mb, "ranks": [r[pick] for r in ranks]}


# -------------------------------------------------------------------------- drawing
def _ratios(rounds: list[float], theirs: list[float]) -> list[float]:
    """Round by round, a system's median step over torch DDP's."""
    return [a / b for a, b in zip(rounds, theirs, strict=True)]


def draw_sweep(data: dict[str, Any], path: Path) -> None:
    """Step time (top) and exposed wait (bottom) against the bucket size, a column a model."""
    models = data["sweep"]
    fig, axes = plt.subplots(2, len(models), figsize=(4 * len(models), 6.4), sharex="col")
    axes = axes.reshape(2, -1)
    styles = {
        "torch_ddp": ("torch DDP, defaults", "tab:gray", "--"),
        "bucketddp": ("bucketddp, defaults (25 MB, first 1 MB)", "tab:blue", ":"),
        "auto": ('bucketddp, bucket_cap_mb="auto"', "tab:green", "-."),
    }
    for col, (name, m) in enumerate(models.items()):
        top, bottom = axes[0, col], axes[1, col]
        caps, points, ref = m["caps"], m["sweep"], m["reference"]
        theirs = ref["torch_ddp"]["round_medians_ms"]
        per_cap = [_ratios(p["round_medians_ms"], theirs) for p in points]
        med = [median(r) for r in per_cap]
        err = [
            [m_ - quantile(r, 0.25) for m_, r in zip(med, per_cap, strict=True)],
            [quantile(r, 0.75) - m_ for m_, r in zip(med, per_cap, strict=True)],
        ]
        top.errorbar(
            caps,
            med,
            yerr=err,
            marker="o",
            color="tab:blue",
            capsize=3,
            label="bucketddp, every bucket this size (p25-p75 of the rounds)",
        )
        bottom.plot(caps, [p["comm_wait_ms"] for p in points], marker="o", color="tab:blue")
        floor = [
            a + b
            for a, b in zip(
                ref["local"]["round_medians_ms"], ref[ALLREDUCE]["round_medians_ms"], strict=True
            )
        ]
        top.axhline(
            median(_ratios(floor, theirs)),
            color="black",
            lw=1,
            label="floor: no-comm step + one all-reduce",
        )
        for s, (label, color, style) in styles.items():
            top.axhline(
                median(_ratios(ref[s]["round_medians_ms"], theirs)),
                color=color,
                ls=style,
                label=label,
            )
            if s != "torch_ddp":  # torch DDP reports no wait
                bottom.axhline(ref[s]["comm_wait_ms"], color=color, ls=style)
        top.set_title(
            f"{name}: {m['gradient_mb']:.1f} MB of gradients,\n"
            f"torch DDP {ref['torch_ddp']['median_ms']:.0f} ms a step"
        )
        bottom.set_ylim(bottom=0)
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(caps, [f"{c:g}" for c in caps])
        bottom.set_xlabel("bucket_cap_mb = first_bucket_mb (MB)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("step time / torch DDP's\n(median of round ratios)")
    axes[1, 0].set_ylabel("exposed wait at the end\nof backward (ms)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False)
    meta = data["meta"]
    fig.suptitle(
        "bucketddp's step time and exposed communication against bucket size\n"
        f"2 ranks, gloo, {meta['cpus']} CPU cores, torch {meta['torch']}; "
        "each system against torch DDP in the same round, median over rounds"
    )
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def draw_timeline(data: dict[str, Any], path: Path) -> None:
    """Per rank, a lane for compute and one per bucket, in ms since the step began."""
    tl = data["timeline"]
    ranks = tl["ranks"]
    zero = min(r["forward"] for r in ranks)

    def ms(t: float) -> float:
        return (t - zero) * 1e3

    n_buckets = max(len(r["buckets"]) for r in ranks)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.5 * len(ranks) * (n_buckets + 1)))
    lanes: list[str] = []
    positions: list[float] = []
    y = 0.0
    colors = {
        "forward": "tab:olive",
        "backward": "tab:blue",
        "wait": "tab:red",
        "optimizer": "tab:purple",
        "allreduce": "tab:orange",
    }
    labelled: set[str] = set()

    def bar(lane: float, start: float, end: float, kind: str, label: str) -> None:
        ax.broken_barh(
            [(ms(start), max(ms(end) - ms(start), 0.05))],
            (lane - 0.35, 0.7),
            color=colors[kind],
            label=None if label in labelled else label,
        )
        labelled.add(label)

    for rank, r in enumerate(ranks):
        lanes.append(f"rank {rank}: compute")
        positions.append(y)
        bar(y, r["forward"], r["backward"], "forward", "forward")
        bar(y, r["backward"], r["wait_started"], "backward", "backward (and its hooks)")
        wait_end = r["wait_started"] + r["wait_seconds"]
        bar(y, r["wait_started"], wait_end, "wait", "end-of-backward wait (exposed)")
        bar(y, r["backward_end"], r["end"], "optimizer", "optimizer step")
        for b in r["buckets"]:
            y += 1
            lanes.append(f"rank {rank}: bucket {b['index']} ({b['nbytes'] / 2**20:.1f} MB)")
            positions.append(y)
            bar(y, b["launched"], b["completed"], "allreduce", "bucket all-reduce")
            ax.plot(
                [ms(b["ready"])],
                [y],
                marker="v",
                color="black",
                ls="",
                label=None if "ready" in labelled else "bucket ready (last gradient in)",
            )
            labelled.add("ready")
        y += 1.5
    ax.set_yticks(positions, lanes)
    ax.invert_yaxis()
    ax.set_xlabel("time since the step began (ms)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    sizes = "default bucket sizes" if tl["cap_mb"] is None else f"{tl['cap_mb']:g} MB buckets"
    meta = data["meta"]
    ax.set_title(
        f"One step of {tl['model']} on 2 ranks ({sizes}; gloo, {meta['cpus']} CPU cores):\n"
        "when each bucket's last gradient arrived, its all-reduce, and the wait at the end"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per round (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per round (default 2)")
    p.add_argument("--timeline-model", choices=list(MODELS), default="deep_transformer")
    p.add_argument(
        "--timeline-cap-mb",
        type=float,
        default=1.0,
        help="bucket_cap_mb = first_bucket_mb of the timeline's step (default 1)",
    )
    p.add_argument("--out", type=Path, default=IMAGES, help=f"default: {IMAGES}")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"default: {DEFAULT_JSON}")
    p.add_argument("--replot", action="store_true", help="measure nothing: draw from --json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure (unless ``--replot``), save the JSON, and draw both pictures."""
    args = parse_args(argv)
    started = time.perf_counter()
    if args.replot:
        data = json.loads(args.json.read_text())
    else:
        data = {"meta": run_meta(loadavg_start=loadavg()), "sweep": {}}
        for name in args.models:
            data["sweep"][name] = measure_sweep(name, args.rounds, args.steps, args.warmup)
            print(f"  sweep {name}: done ({time.perf_counter() - started:.0f}s)", flush=True)
        data["timeline"] = measure_timeline(args.timeline_model, args.timeline_cap_mb)
        data["meta"]["loadavg_end"] = loadavg()
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1))
        print(f"wrote {args.json}")
    args.out.mkdir(parents=True, exist_ok=True)
    draw_sweep(data, args.out / "bucket-sweep.png")
    draw_timeline(data, args.out / "overlap-timeline.png")
    print(
        f"wrote {args.out}/bucket-sweep.png and overlap-timeline.png "
        f"({time.perf_counter() - started:.0f}s in all)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
