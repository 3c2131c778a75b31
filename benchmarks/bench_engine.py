"""Benchmark the engine: step time and peak memory of bucketddp against torch DDP on CPU/gloo.

Three systems train each model (see ``models.py``) with SGD and momentum:

- ``local``: the bare model, no communication: the floor the other two are measured against;
- ``torch_ddp``: ``torch.nn.parallel.DistributedDataParallel`` with its default options;
- ``bucketddp``: ``bucketddp.BucketDataParallel`` with its default options.

With ``--null``, a fourth: ``torch_ddp_b``, a second torch DDP, whose ratio to the first
shows how far apart two identical systems come out (the noise floor of the comparison).

Step times come from one pair of processes per model that keeps all systems alive and runs
them in interleaved rounds, in an order that changes every round (each system follows every
other equally often), so that slow drifts of the machine hit every system alike. Peak
memory comes from a fresh pair of processes per (model, system), because a process's peak
resident set size only ever grows.
See ``docs/benchmarks.md`` for how to read the output.

Usage::

    python benchmarks/bench_engine.py            # the full run, a few minutes on 2 cores
    python benchmarks/bench_engine.py --quick    # a smoke run, under a minute
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import resource
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import bucketddp
from bucketddp import BucketDataParallel
from models import MODELS, Batch, ModelSpec, count_parameters, loss_fn

SYSTEMS = ("local", "torch_ddp", "bucketddp")
NULL_SYSTEM = "torch_ddp_b"
"""A second torch DDP (``--null``): the A/A comparison that shows the noise floor."""
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "engine.json"
LR = 0.01
MOMENTUM = 0.9


@dataclass(frozen=True)
class Config:
    """The knobs of one timing run, shipped to every rank."""

    rounds: int
    steps: int
    warmup: int
    batch_size: int | None
    """Per-rank batch size; None means each model's own default."""
    memory_steps: int
    bucket_cap_mb: float | None = None
    """bucket_cap_mb of both wrappers; None leaves each at its default (25 MB)."""
    first_bucket_mb: float | None = None
    """bucketddp's first_bucket_mb; None means torch DDP's first bucket: 1 MB with the
    default cap, and ``bucket_cap_mb`` itself when that is given (torch 2.13's rule)."""
    comm_hook: str | None = None
    """A key of COMM_HOOKS registered on both wrappers; None for their own all-reduce."""
    device: str = "cpu"
    """"cpu" (gloo) or "cuda" (NCCL, one GPU per rank)."""
    malloc_mmap_kb: int | None = None
    """CPU memory runs: glibc maps each allocation of at least this many KiB on its own and
    returns it when freed (see ``exact_malloc``); None leaves the allocator as it is."""


COMM_HOOKS = {
    "allreduce": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
}
"""The communication hooks ``--comm-hook`` offers: torch's own, given to both wrappers."""


# --------------------------------------------------------------------- process launch
def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    backend: str,
    results: Any,
) -> None:
    # One intra-op thread per rank: two ranks share this machine's cores, and oversubscribed
    # threads would measure the scheduler rather than the reducer.
    torch.set_num_threads(1)
    try:
        device: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = {"device_id": torch.device("cuda", rank)}
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
            **device,
        )
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 900.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes of ``backend``.

    Returns the per-rank results in rank order. Raises RuntimeError with the failing rank's
    traceback if a rank raises or dies, and TimeoutError if the ranks outlive ``timeout``.
    ``fn`` must be a module-level function; its result must be picklable.
    """
    ctx = mp.get_context("forkserver")
    # A rank forks from a server that has torch imported: a fraction of a second to start,
    # against seconds for a fresh interpreter. Memory figures are deltas within a rank, so
    # the pages it shares with the server do not count against any system.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "bucketddp", "models"])
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, args, backend, results))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode]
                if dead:
                    raise RuntimeError(
                        f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                        "without a result"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{fn.__name__} on {world_size} ranks ran past {timeout:.0f}s"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} raised:\n{payload}")
            done[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [done[r] for r in range(world_size)]


# ------------------------------------------------------------------------ one rank
def wrap(system: str, model: nn.Module, cfg: Config) -> nn.Module:
    """The model as ``system`` trains it: bare, in torch DDP, or in BucketDataParallel.

    Both wrappers use their default options, except for the bucket sizes and the
    communication hook ``cfg`` sets.
    """
    cap = {} if cfg.bucket_cap_mb is None else {"bucket_cap_mb": cfg.bucket_cap_mb}
    wrapped: DistributedDataParallel | BucketDataParallel
    if system == "local":
        return model
    if system in ("torch_ddp", NULL_SYSTEM):
        wrapped = DistributedDataParallel(model, **cap)
    elif system == "bucketddp":
        # torch DDP makes its first bucket as large as an explicit bucket_cap_mb: the same
        # here, unless a first bucket size is asked for, so both launch the same buckets.
        first_mb = cfg.bucket_cap_mb if cfg.first_bucket_mb is None else cfg.first_bucket_mb
        first = {} if first_mb is None else {"first_bucket_mb": first_mb}
        wrapped = BucketDataParallel(model, **cap, **first)
    else:
        raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
    if cfg.comm_hook is not None:
        wrapped.register_comm_hook(None, COMM_HOOKS[cfg.comm_hook])
    return wrapped


def round_order(systems: Sequence[str], round_: int) -> list[str]:
    """The order of ``systems`` in round ``round_``, from a Williams design.

    Over a cycle of rounds (as many as systems when their number is even, twice that when
    it is odd) every system runs in every position equally often and directly follows
    every other system equally often, so neither a slot in the round nor the system that
    ran just before (its warm caches, its leftover gloo traffic) favours one of them. A
    plain rotation balances the positions only: with three systems, one of them would
    follow a given other in two rounds of three.
    """
    n = len(systems)
    first = [0]
    low, high = 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + k) % n for x in first] for k in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [systems[i] for i in rows[round_ % len(rows)]]


def make_batches(spec: ModelSpec, cfg: Config, rank: int, round_: int, count: int) -> list[Batch]:
    """The batches of one round on one rank: the same for every system in that round."""
    size = cfg.batch_size or spec.batch_size
    made = [spec.batch(size, seed=1_000_000 * round_ + 1000 * rank + i) for i in range(count)]
    return [(x.to(cfg.device), y.to(cfg.device)) for x, y in made]


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Batch],
    cuda: bool = False,
) -> list[list[float]]:
    """Train one step per batch; per step: [total, forward, backward, optimizer, wait, cpu] s.

    The forward phase includes the loss; the optimizer phase includes ``zero_grad``.
    ``wait`` is bucketddp's own ``comm_stats.wait_seconds`` (0 for other systems); ``cpu``
    is the CPU time of the whole process (every thread, gloo's included) during the step.
    On CUDA the step ends with a device synchronize, so the total covers the GPU's work;
    the phases are then the host's time to issue each one.
    """
    rows = []
    if cuda:
        torch.cuda.synchronize()
    for batch in batches:
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = loss_fn(model, batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        wait = model.comm_stats.wait_seconds if isinstance(model, BucketDataParallel) else 0.0
        rows.append([t3 - t0, t1 - t0, t2 - t1, t3 - t2, wait, time.process_time() - c0])
    return rows


def time_model(
    rank: int, world_size: int, model_name: str, systems: Sequence[str], cfg: Config
) -> dict[str, Any]:
    """Interleaved rounds of every system on one model; returns per-round step figures.

    Each step's total time is the max over ranks (a step is as slow as its slowest rank);
    the phase columns are the mean over ranks.
    """
    spec = MODELS[model_name]
    models = {s: wrap(s, spec.build(seed=0).to(cfg.device), cfg) for s in systems}
    optimizers = {
        s: torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for s, m in models.items()
    }
    per_round: dict[str, list[list[list[float]]]] = {s: [] for s in systems}
    for r in range(cfg.rounds):
        batches = make_batches(spec, cfg, rank, r, cfg.warmup + cfg.steps)
        for s in round_order(systems, r):
            dist.barrier()
            rows = train_steps(models[s], optimizers[s], batches, cfg.device == "cuda")
            rows = rows[cfg.warmup :]
            # On the ranks' device: NCCL reduces CUDA tensors only.
            figures = torch.tensor(rows, dtype=torch.float64, device=cfg.device)
            slowest = figures[:, :1].clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            mean = figures[:, 1:].clone()
            dist.all_reduce(mean)
            mean /= world_size
            per_round[s].append(torch.cat([slowest, mean], dim=1).tolist())
    info: dict[str, Any] = {"params": count_parameters(models[systems[0]])}
    if "bucketddp" in models:
        plan = models["bucketddp"].bucket_plan
        info["bucketddp_buckets"] = len(plan)
        info["bucketddp_bucket_mb"] = [round(b.nbytes / 2**20, 3) for b in plan]
        info["bucketddp_collectives"] = models["bucketddp"].comm_stats.collectives
    if "torch_ddp" in models:
        info["torch_ddp_bucket_mb"] = ddp_bucket_mb(models["torch_ddp"])
    return {"per_round": per_round, **info}


def ddp_bucket_mb(model: nn.Module) -> list[float] | None:
    """The bucket sizes torch DDP settled on after its rebuild, in MB; None if unavailable.

    Read from DDP's own logging data, a private method: the benchmark's window on whether both
    engines run the same collectives.
    """
    try:
        sizes = model._get_ddp_logging_data().get("rebuilt_bucket_sizes")  # type: ignore[operator]
    except (AttributeError, RuntimeError):
        return None
    if not isinstance(sizes, str) or not sizes:
        return None
    return [round(int(b) / 2**20, 3) for b in sizes.split(",")]


def _rss_kb() -> int:
    """Current resident set size of this process in KiB (Linux), else the peak so far."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def exact_malloc(threshold_kb: int) -> None:
    """Make glibc map each allocation of ``threshold_kb`` KiB or more on its own, and unmap it
    when freed; heap memory above the top is returned at once.

    With glibc's defaults, a freed block is kept for reuse and the mmap threshold grows with
    the blocks freed, so a process's peak RSS depends on the order of its allocations as
    much as on their sizes: a few MB either way between fresh processes running the same
    code. With this, RSS follows the memory in use, and the pairs agree to a fraction of a
    MB. Linux with glibc only; raises RuntimeError elsewhere.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    trim = getattr(libc, "malloc_trim", None)
    # mallopt's parameter numbers, from glibc's malloc.h.
    m_trim_threshold, m_mmap_threshold = -1, -3
    if (
        mallopt is None
        or trim is None
        or mallopt(m_mmap_threshold, threshold_kb * 1024) != 1
        or mallopt(m_trim_threshold, 0) != 1
    ):
        raise RuntimeError(
            "--malloc-mmap-kb needs glibc's mallopt (Linux); this C library has none or "
            "refused the threshold. Run without --malloc-mmap-kb here."
        )
    trim(0)


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_memory(
    rank: int, world_size: int, model_name: str, system: str, cfg: Config
) -> dict[str, Any]:
    """Peak RSS growth of one system in a fresh process, from "model built" to "steps done".

    The baseline is taken after the model and the batches exist but before wrapping, so the
    figure covers what the wrapper adds (buckets, bookkeeping, gloo buffers) plus what
    training adds (gradients, momentum, activations), and not the model itself. On CUDA
    the figures are the GPU memory torch's allocator hands out, from the same point.
    """
    spec = MODELS[model_name]
    model = spec.build(seed=0).to(cfg.device)
    batches = make_batches(spec, cfg, rank, 0, cfg.memory_steps)
    dist.barrier()
    if cfg.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        wrapped = wrap(system, model, cfg)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR, momentum=MOMENTUM)
        train_steps(wrapped, optimizer, batches, cuda=True)
        peak = torch.cuda.max_memory_allocated()
        return {
            "baseline_mb": base / 2**20,
            "peak_mb": peak / 2**20,
            "delta_mb": (peak - base) / 2**20,
            "peak_reset": True,
        }
    if cfg.malloc_mmap_kb is not None:
        exact_malloc(cfg.malloc_mmap_kb)
    reset = _reset_peak_rss()
    baseline_kb = _rss_kb()
    wrapped = wrap(system, model, cfg)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR, momentum=MOMENTUM)
    train_steps(wrapped, optimizer, batches)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "baseline_mb": baseline_kb / 1024,
        "peak_mb": peak_kb / 1024,
        "delta_mb": (peak_kb - baseline_kb) / 1024,
        "peak_reset": reset,
        "malloc_mmap_kb": cfg.malloc_mmap_kb,
    }


def measure_model_memory(
    name: str, cfg: Config, repeats: int, backend: str
) -> dict[str, dict[str, Any]]:
    """Peak memory of every system on one model: ``repeats`` fresh pairs each, interleaved.

    Each pair gives the larger of its two ranks' figures; a system's ``delta_mb`` is the
    median over its pairs (``repeats_delta_mb`` lists them), which tames the allocator's
    run-to-run noise of a few MB.
    """
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    for r in range(repeats):
        for s in round_order(SYSTEMS, r):
            ranks = run_ranks(measure_memory, 2, name, s, cfg, backend=backend)
            worst = max(ranks, key=lambda m: m["delta_mb"])
            runs[s].append({**worst, "per_rank_delta_mb": [m["delta_mb"] for m in ranks]})
    out = {}
    for s, pairs in runs.items():
        deltas = [p["delta_mb"] for p in pairs]
        median = statistics.median(deltas)
        middle = min(pairs, key=lambda p: abs(p["delta_mb"] - median))
        out[s] = {**middle, "delta_mb": median, "repeats_delta_mb": deltas}
    return out


# ----------------------------------------------------------------------- analysis
def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _quantile(xs: Sequence[float], q: float) -> float:
    ordered = sorted(xs)
    if not ordered:
        return float("nan")
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def bootstrap_ci(
    xs: Sequence[float], *, level: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``xs`` (deterministic for one seed).

    Resamples ``xs`` with replacement, takes each resample's median and returns the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of those medians.
    """
    if not xs:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    medians = [statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples)]
    tail = (1 - level) / 2
    return _quantile(medians, tail), _quantile(medians, 1 - tail)


def verdict(ci: tuple[float, float]) -> str:
    """Read a ratio's interval: below 1 is faster, above 1 slower, across 1 within noise."""
    lo, hi = ci
    if hi < 1:
        return "faster"
    if lo > 1:
        return "slower"
    return "within noise"


def _compare(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Step-time ratios of one system's figures over another's: pooled and per round."""
    round_ratios = [
        a / b for a, b in zip(ours["round_medians_ms"], theirs["round_medians_ms"], strict=True)
    ]
    return {
        "ratio_of_medians": ours["median_ms"] / theirs["median_ms"],
        "median_round_ratio": _median(round_ratios),
        "round_ratios": round_ratios,
        "round_ratio_ci95": list(bootstrap_ci(round_ratios)),
    }


def summarize(raw: dict[str, Any], systems: Sequence[str]) -> dict[str, Any]:
    """Medians, ratios and exposed communication of one model's timing run (in ms)."""
    per_round = raw["per_round"]
    out: dict[str, Any] = {"params": raw["params"], "systems": {}}
    for s in systems:
        rounds = per_round[s]
        steps = [row for rnd in rounds for row in rnd]
        totals = [1000 * row[0] for row in steps]
        out["systems"][s] = {
            "median_ms": _median(totals),
            "p25_ms": _quantile(totals, 0.25),
            "p75_ms": _quantile(totals, 0.75),
            "round_medians_ms": [_median([1000 * row[0] for row in rnd]) for rnd in rounds],
            "forward_ms": _median([1000 * row[1] for row in steps]),
            "backward_ms": _median([1000 * row[2] for row in steps]),
            "optimizer_ms": _median([1000 * row[3] for row in steps]),
            "comm_wait_ms": _median([1000 * row[4] for row in steps]),
            "cpu_ms": _median([1000 * row[5] for row in steps]),
            "step_ms": [[1000 * row[0] for row in rnd] for rnd in rounds],
        }
    figures = out["systems"]
    if "local" in figures:
        floor = figures["local"]["median_ms"]
        for s in systems:
            if s != "local":
                figures[s]["exposed_comm_ms"] = figures[s]["median_ms"] - floor
    if "torch_ddp" in figures and "bucketddp" in figures:
        out.update(_compare(figures["bucketddp"], figures["torch_ddp"]))
        out["cpu_ratio"] = figures["bucketddp"]["cpu_ms"] / figures["torch_ddp"]["cpu_ms"]
    if "torch_ddp" in figures and NULL_SYSTEM in figures:
        null = _compare(figures[NULL_SYSTEM], figures["torch_ddp"])
        out.update({f"null_{key}": value for key, value in null.items()})
    if "local" in figures and "bucketddp" in figures:
        out["bucketddp_over_local"] = (
            figures["bucketddp"]["median_ms"] / figures["local"]["median_ms"]
        )
        out["bucketddp_over_local_rounds"] = _median(
            [
                a / b
                for a, b in zip(
                    figures["bucketddp"]["round_medians_ms"],
                    figures["local"]["round_medians_ms"],
                    strict=True,
                )
            ]
        )
    kept = ("bucketddp_buckets", "bucketddp_bucket_mb", "bucketddp_collectives")
    for key in (*kept, "torch_ddp_bucket_mb"):
        if key in raw:
            out[key] = raw[key]
    return out


# ------------------------------------------------------------------------- output
def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.0f}K"


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
    header = (
        f"{'model':<19} {'system':<10} {'step ms':>8} {'p25-p75 ms':>13} {'x local':>8} "
        f"{'exposed ms':>10} {'fwd':>6} {'bwd':>6} {'opt':>6} {'wait':>6} {'cpu':>6} "
        f"{'peak MB (vs local)':>19}"
    )
    print(header)
    print("-" * len(header))
    for name, res in results.items():
        figures = res["systems"]
        floor = figures.get("local", {}).get("median_ms")
        for i, (s, f) in enumerate(figures.items()):
            label = f"{name} ({_fmt_params(res['params'])})" if i == 0 else ""
            rel = f"{f['median_ms'] / floor:.3f}" if floor else "-"
            exposed = f"{f['exposed_comm_ms']:+.1f}" if "exposed_comm_ms" in f else "-"
            mem = memory.get(name, {}).get(s)
            peak = _fmt_peak(mem, memory.get(name, {}).get("local"))
            wait = f"{f['comm_wait_ms']:.1f}" if s == "bucketddp" else "-"
            print(
                f"{label:<19} {s:<10} {f['median_ms']:8.1f} "
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


# ------------------------------------------------------------------------ pooling
POOL_KEYS = ("steps", "warmup", "batch_size", "bucket_cap_mb", "first_bucket_mb", "comm_hook")
"""Config entries that must agree between pooled runs (rounds and models may differ)."""


def pool_reports(reports: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Pool the round ratios of several runs' JSON reports, per section and model.

    Raises ValueError, naming the file, if a report was made with other step counts,
    batch size or bucket options than the first one: their ratios do not measure the same
    thing.
    """
    for name, report in reports:
        if not isinstance(report, dict) or "config" not in report:
            raise ValueError(f"{name}: not a report of bench_engine.py (it has no 'config')")
    first_name, first = reports[0]
    pooled: dict[str, Any] = {}
    for name, report in reports:
        for key in POOL_KEYS:
            if report["config"].get(key) != first["config"].get(key):
                raise ValueError(
                    f"{name}: {key} is {report['config'].get(key)!r}, but "
                    f"{first['config'].get(key)!r} in {first_name}; pool only runs made with "
                    "the same options"
                )
        for section in ("world_size_2", "world_size_1"):
            for model, res in report.get(section, {}).items():
                if "round_ratios" not in res:
                    continue
                entry = pooled.setdefault(section, {}).setdefault(model, {"runs": 0})
                entry["runs"] += 1
                for prefix in ("", "null_"):  # bucketddp's ratios, then the null's if run
                    if f"{prefix}round_ratios" in res:
                        entry.setdefault(f"{prefix}round_ratios", []).extend(
                            res[f"{prefix}round_ratios"]
                        )
                        entry.setdefault(f"{prefix}ratio_of_medians", []).append(
                            res[f"{prefix}ratio_of_medians"]
                        )
    for models in pooled.values():
        for entry in models.values():
            for prefix in ("", "null_"):
                if f"{prefix}round_ratios" in entry:
                    ratios = entry[f"{prefix}round_ratios"]
                    entry[f"{prefix}median_round_ratio"] = _median(ratios)
                    entry[f"{prefix}round_ratio_ci95"] = list(bootstrap_ci(ratios))
    return pooled


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
                f"{model:<12} median of {len(e['round_ratios'])} round ratios "
                f"{e['median_round_ratio']:.3f}, 95% interval {lo:.3f}-{hi:.3f}, "
                f"{verdict((lo, hi))}; ratio of medians per run: {per_run}"
            )
            if "null_round_ratios" in e:
                lo, hi = e["null_round_ratio_ci95"]
                print(
                    f"{'':<12} null, {NULL_SYSTEM}/torch_ddp: median of "
                    f"{len(e['null_round_ratios'])} round ratios {e['null_median_round_ratio']:.3f}"
                    f", 95% interval {lo:.3f}-{hi:.3f} (from {len(e['null_ratio_of_medians'])} of "
                    f"the {e['runs']} runs)"
                )
    return 0


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load averages, rounded, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_meta(**extra: Any) -> dict[str, Any]:
    """What a benchmark's JSON records of the run: date, versions, machine, then ``extra``."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "bucketddp": bucketddp.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "threads_per_rank": 1,
        "backend": "gloo",
        **extra,
    }


# ----------------------------------------------------------------------------- main
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

    timed = (*SYSTEMS, NULL_SYSTEM) if args.null else SYSTEMS
    sections = [(2, args.models, timed), (1, args.ws1_models, SYSTEMS)]
    for world_size, names, systems in sections:
        if world_size not in args.world_size:
            continue
        results = {}
        for name in names:
            raw = run_ranks(time_model, world_size, name, systems, cfg, backend=backend)[0]
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
