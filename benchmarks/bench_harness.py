"""The engine benchmark's harness: what runs on the ranks, and how it is timed.

``time_model`` trains every system on one model in one pair of processes, in interleaved
rounds (``round_order``), beside a standalone all-reduce of the gradients' bytes (the
wire). It runs through ``run_ranks``, the tests' rank launcher
(``tools/multirank.py``): one intra-op thread per rank, a real process group on a
free loopback port. ``bench_memory.py`` measures peak memory, ``bench_stats.py`` turns the
figures into medians and ratios, and ``bench_engine.py`` is the command line.
bench_syncbn.py, bench_lightning.py and bench_plots.py reuse ``train_steps``, ``run_meta``,
``time_model`` and the optimizer settings.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import bucketddp
from bucketddp import BucketDataParallel
from bucketddp.options import AUTO, EngineOptions
from models import MODELS, Batch, ModelSpec, count_parameters, count_tensors, loss_fn

# The one rank launcher, shared with the tests, in tools/. Appended, not prepended: every
# module of this directory (``models``: the benchmark models) comes first.
TOOLS = Path(__file__).resolve().parents[1] / "tools"
if str(TOOLS) not in sys.path:
    sys.path.append(str(TOOLS))
from bf16 import bf16_allreduce_hook  # noqa: E402  (tools/bf16.py)
from multirank import run_ranks  # noqa: E402, F401  (re-exported to the benchmarks)

RANKS_TIMEOUT = 2400.0
"""Seconds one ``run_ranks`` call of a benchmark may take: a whole model's timing run."""

SYSTEMS = ("local", "torch_ddp", "bucketddp")
NULL_SYSTEM = "torch_ddp_b"
"""A second torch DDP (``--null``): the A/A comparison that shows the noise floor."""
ALLREDUCE = "allreduce"
"""Not a system but the wire: one all-reduce of a flat tensor as large as the model's
gradients, timed in the rounds like a system. A step's floor is local + allreduce."""
TUNING_STEPS = 64
"""Most untimed steps a variant with ``"auto"`` bucket sizes may take to choose them."""
PROBE_STEPS = 3
"""Untimed steps per system that measure a model's step for ``round_steps``."""
MOST_STEPS = 16
"""``round_steps`` times at most this many times ``Config.steps`` per round."""
T = TypeVar("T")
Variant = tuple[str, tuple[tuple[str, Any], ...]]
"""``--variant``: a system's name and the engine options its BucketDataParallel takes."""
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
    variants: tuple[Variant, ...] = ()
    """bucketddp systems with engine options of their own (``--variant``), timed beside
    the others and compared with ``bucketddp``."""
    min_round_ms: float = 0.0
    """Time at least this long per system and round (``round_steps``): a model with short
    steps gets more than ``steps`` of them. 0 times ``steps`` on every model."""


def add_run_options(p: argparse.ArgumentParser, default_json: Path, pool_help: str) -> None:
    """The options every benchmark takes: ``--quick``, ``--json`` and ``--pool``."""
    p.add_argument("--quick", action="store_true", help="a smoke run: small rounds and steps")
    p.add_argument("--json", type=Path, default=default_json, help=f"default: {default_json}")
    p.add_argument("--pool", type=Path, nargs="+", metavar="JSON", help=f"run nothing: {pool_help}")


def parse_variant(text: str) -> Variant:
    """``NAME:option=value[,option=value...]``: a bucketddp system with engine options.

    Values are Python literals (``True``, ``4``, ``0.5``, ``'mean'``), or else strings.
    The options are checked as the wrapper checks them.

    Raises:
        ValueError: bad syntax, a name of the built-in systems, an unknown option or a
            bad value, naming it.
    """
    name, colon, rest = text.partition(":")
    if not colon or not name.isidentifier() or not rest:
        raise ValueError(
            f"--variant {text!r}: expected NAME:option=value[,option=value...], such as "
            "bucketddp_finite:check_finite=True"
        )
    if name in (*SYSTEMS, NULL_SYSTEM):
        raise ValueError(f"--variant {name}: that name is a built-in system; pick another")
    known = sorted(f.name for f in dataclasses.fields(EngineOptions) if f.name != "unused_hint")
    options = []
    for item in rest.split(","):
        key, equals, raw = (part.strip() for part in item.partition("="))
        if not equals or key not in known:
            raise ValueError(f"--variant {name}: unknown engine option {key!r}; one of {known}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        options.append((key, value))
    try:
        EngineOptions(**dict(options))
    except (TypeError, ValueError) as err:
        raise ValueError(f"--variant {name}: {err}") from None
    return name, tuple(options)


def _powersgd(torch_ddp: bool) -> tuple[Any, Any]:
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
    )
    return state, powerSGD_hook.powerSGD_hook


COMM_HOOKS: dict[str, Callable[[bool], tuple[Any, Any]]] = {
    "fp16": lambda torch_ddp: (None, default_hooks.fp16_compress_hook),
    # torch DDP refuses torch's bf16 hook by name without NCCL; on gloo it runs the same
    # arithmetic under another name (tools/bf16.py).
    "bf16": lambda torch_ddp: (
        None,
        bf16_allreduce_hook
        if torch_ddp and not torch.cuda.is_available()
        else default_hooks.bf16_compress_hook,
    ),
    "powersgd": _powersgd,  # rank 1, compressing from the second step
    "allreduce": lambda torch_ddp: (None, default_hooks.allreduce_hook),
}
"""The communication hooks the benchmark offers: ``name -> f(torch_ddp) -> (state, hook)``,
a fresh state per wrapper. ``--comm-hook`` gives one to every wrapper; ``--hooks`` times
each as a pair of systems of its own, ``torch_ddp+NAME`` and ``bucketddp+NAME``."""
ONE_BUCKET = {"powersgd": 64.0}
"""Hooks timed with one bucket on both wrappers, of this many MB: torch DDP with PowerSGD on
gloo stops with a size mismatch when there are two (docs/comm-hooks.md)."""
HOOKED = "+"
"""Joins a wrapper and a hook in a system's name: ``bucketddp+fp16``."""


def counterparts(systems: Sequence[str]) -> list[tuple[str, str, str]]:
    """(torch DDP system, bucketddp system, hook) for each bucketddp system of ``systems``
    whose torch DDP counterpart is there too: ``("torch_ddp", "bucketddp", "")``,
    ``("torch_ddp+fp16", "bucketddp+fp16", "fp16")``."""
    out = []
    for s in systems:
        wrapper, joined, hook = s.partition(HOOKED)
        theirs = f"torch_ddp{joined}{hook}"
        if wrapper == "bucketddp" and theirs in systems:
            out.append((theirs, s, hook))
    return out


def hooked_systems(hooks: Sequence[str]) -> list[str]:
    """The systems that time ``hooks``: torch DDP and bucketddp with each."""
    return [f"{s}{HOOKED}{h}" for h in hooks for s in ("torch_ddp", "bucketddp")]


def wrap(system: str, model: nn.Module, cfg: Config) -> nn.Module:
    """The model as ``system`` trains it: bare, in torch DDP, or in BucketDataParallel.

    Both wrappers use their default options, except for the bucket sizes and the
    communication hook ``cfg`` sets, and a variant's own engine options.
    """
    system, _, hook_name = system.partition(HOOKED)
    hook = hook_name or cfg.comm_hook
    cap_mb = ONE_BUCKET.get(hook or "", cfg.bucket_cap_mb)
    cap = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    wrapped: DistributedDataParallel | BucketDataParallel
    if system == "local":
        return model
    if system in ("torch_ddp", NULL_SYSTEM):
        wrapped = DistributedDataParallel(model, **cap)
    elif system == "bucketddp" or system in dict(cfg.variants):
        # torch DDP makes its first bucket as large as an explicit bucket_cap_mb: the same
        # here, unless a first bucket size is asked for, so both launch the same buckets.
        first_mb = cap_mb if cfg.first_bucket_mb is None else cfg.first_bucket_mb
        first = {} if first_mb is None else {"first_bucket_mb": first_mb}
        own = dict(dict(cfg.variants).get(system, ()))
        wrapped = BucketDataParallel(model, **{**cap, **first, **own})
    else:
        names = [*SYSTEMS, *(v for v, _ in cfg.variants)]
        raise ValueError(f"unknown system {system!r}; choose from {names}")
    if hook is not None:
        state, fn = COMM_HOOKS[hook](isinstance(wrapped, DistributedDataParallel))
        wrapped.register_comm_hook(state, fn)
    return wrapped


def turn_order(systems: Sequence[str], round_: int, step: int = 0) -> list[str]:
    """The order in which ``systems`` take step ``step`` of round ``round_``, one each.

    Each bucketddp system steps right next to its torch DDP counterpart (``bucketddp`` with
    ``torch_ddp``, ``bucketddp+fp16`` with ``torch_ddp+fp16``), so that every step of one
    has a step of the other a few milliseconds away, under the same load
    (``bench_stats.step_ratios``). The pairs and the other systems are ordered by
    ``round_order``, the same for every step of a round. Within a pair the two take turns
    at going first from step to step: whatever the system before the pair leaves behind
    (its caches, its gloo traffic) falls on each of the two equally often, in every round,
    whichever system that is.
    """
    pairs = {ours: theirs for theirs, ours, _ in counterparts(systems)}
    partnered = set(pairs.values())
    units = [(pairs[s], s) if s in pairs else (s,) for s in systems if s not in partnered]
    flip = (round_ + step) % 2
    return [s for unit in round_order(units, round_) for s in (unit[::-1] if flip else unit)]


def round_order(systems: Sequence[T], round_: int) -> list[T]:
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
        t0, t1, t2, t3 = timed_step(model, optimizer, batch, cuda)
        cpu = time.process_time() - c0  # before reading bucketddp's figures, which cost CPU
        wait = model.comm_stats.wait_seconds if isinstance(model, BucketDataParallel) else 0.0
        rows.append([t3 - t0, t1 - t0, t2 - t1, t3 - t2, wait, cpu])
    return rows


def timed_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, cuda: bool = False
) -> tuple[float, float, float, float]:
    """One training step; ``perf_counter()`` at its start, backward, optimizer step and end."""
    t0 = time.perf_counter()
    loss = loss_fn(model, batch)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    return t0, t1, t2, time.perf_counter()


def time_model(
    rank: int, world_size: int, model_name: str, systems: Sequence[str], cfg: Config
) -> dict[str, Any]:
    """Interleaved rounds of every system on one model; returns per-round step figures.

    Each step's total time is the max over ranks (a step is as slow as its slowest rank);
    the phase columns are the mean over ranks. ``ALLREDUCE`` among ``systems`` times the
    wire instead of a model (``time_allreduce``). A variant with ``"auto"`` bucket sizes
    trains untimed steps until it has chosen them (``tune``), so no tuning step is timed.
    """
    spec = MODELS[model_name]
    models = {s: wrap(s, spec.build(seed=0).to(cfg.device), cfg) for s in systems if s != ALLREDUCE}
    optimizers = {
        s: torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for s, m in models.items()
    }
    bare = spec.build(seed=0)
    grad_bytes = sum(p.numel() * p.element_size() for p in bare.parameters() if p.requires_grad)
    # Zeros: their sum stays zero, with no overflow nor denormals however often it runs.
    wire = torch.zeros(grad_bytes // 4, dtype=torch.float32, device=cfg.device)
    tuning = {
        s: tune(models[s], optimizers[s], make_batches(spec, cfg, rank, cfg.rounds, 1), cfg)
        for s in models
        if is_auto(s, cfg)
    }
    steps, probe_ms = round_steps(models, optimizers, spec, cfg, rank)
    per_round: dict[str, list[list[list[float]]]] = {s: [] for s in systems}
    cuda = cfg.device == "cuda"
    for r in range(cfg.rounds):
        batches = make_batches(spec, cfg, rank, r, cfg.warmup + steps)
        rows: dict[str, list[list[float]]] = {s: [] for s in systems}
        for k, batch in enumerate(batches):  # the systems take turns step by step
            for s in turn_order(systems, r, k):
                dist.barrier()
                if s == ALLREDUCE:
                    rows[s] += time_allreduce(wire, 1, cuda)
                else:
                    rows[s] += train_steps(models[s], optimizers[s], [batch], cuda)
        for s in systems:
            per_round[s].append(over_ranks(rows[s][cfg.warmup :], world_size, cfg.device))
    info: dict[str, Any] = {
        "steps_per_round": steps,
        "probe_step_ms": probe_ms,
        "params": count_parameters(bare),
        "tensors": count_tensors(bare),
        "gradient_mb": round(grad_bytes / 2**20, 3),
    }
    if "bucketddp" in models:
        plan = models["bucketddp"].bucket_plan
        info["bucketddp_buckets"] = len(plan)
        info["bucketddp_bucket_mb"] = [round(b.nbytes / 2**20, 3) for b in plan]
        info["bucketddp_collectives"] = models["bucketddp"].comm_stats.collectives
    if "torch_ddp" in models:
        info["torch_ddp_bucket_mb"] = ddp_bucket_mb(models["torch_ddp"])
    # What each variant's wrapper was given (its options as they reached it), its buckets,
    # and for "auto" the sizes it chose and the untimed steps it took to choose them.
    info["variant_options"] = {
        name: {key: getattr(models[name].options, key) for key, _ in options}
        for name, options in cfg.variants
        if name in models
    }
    info["variant_bucket_mb"] = {
        name: [round(b.nbytes / 2**20, 3) for b in models[name].bucket_plan]
        for name, _ in cfg.variants
        if name in models
    }
    info["variant_tuning"] = tuning
    return {"per_round": per_round, **info}


def round_steps(
    models: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    spec: ModelSpec,
    cfg: Config,
    rank: int,
) -> tuple[int, float | None]:
    """Timed steps per system and round, and the probe's step in ms (None without one).

    ``cfg.steps``, or more for a model whose steps are
    short, so that a round times at least ``cfg.min_round_ms`` per system.

    A round's median over a few steps of a millisecond or two moves with every hiccup of
    the machine; over more steps it holds still, and so does the round's ratio. Every
    system trains ``PROBE_STEPS`` untimed steps on the same batches; the median of those
    steps, on the slowest rank, sets the count (the same on every rank), at most
    ``MOST_STEPS`` times ``cfg.steps``.
    """
    if cfg.min_round_ms <= 0 or not models:
        return cfg.steps, None
    batches = make_batches(spec, cfg, rank, cfg.rounds + 1, PROBE_STEPS)
    totals = []
    for s in sorted(models):
        dist.barrier()
        rows = train_steps(models[s], optimizers[s], batches, cfg.device == "cuda")
        totals += [row[0] for row in rows]
    step = torch.tensor([statistics.median(totals)], dtype=torch.float64, device=cfg.device)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    ms = 1000 * step.item()
    wanted = math.ceil(cfg.min_round_ms / max(ms, 1e-3))
    return min(max(cfg.steps, wanted), MOST_STEPS * cfg.steps), ms


def is_auto(system: str, cfg: Config) -> bool:
    """Whether ``system`` is a variant with a bucket size of ``"auto"``."""
    options = dict(dict(cfg.variants).get(system, ()))
    return AUTO in (options.get("bucket_cap_mb"), options.get("first_bucket_mb"))


def tune(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Batch], cfg: Config
) -> dict[str, Any]:
    """Train untimed steps until ``"auto"`` has chosen the bucket sizes; what it chose.

    Every rank reaches the choice at the same step (rank 0 broadcasts it), so the ranks
    leave the loop together. Raises RuntimeError after ``TUNING_STEPS`` steps without one.
    """
    assert isinstance(model, BucketDataParallel)
    steps = 0
    while model.tuned_bucket_sizes is None:
        if steps == TUNING_STEPS:
            raise RuntimeError(
                f'bucket_cap_mb="auto" chose no sizes in {TUNING_STEPS} steps; is telemetry on?'
            )
        train_steps(model, optimizer, batches, cfg.device == "cuda")
        steps += len(batches)
    cap, first = model.tuned_bucket_sizes
    return {"steps": steps, "bucket_cap_mb": cap, "first_bucket_mb": first}


def time_allreduce(wire: torch.Tensor, count: int, cuda: bool = False) -> list[list[float]]:
    """``count`` all-reduces of ``wire``, as ``train_steps`` rows (the phases are 0)."""
    rows = []
    for _ in range(count):
        c0 = time.process_time()
        t0 = time.perf_counter()
        dist.all_reduce(wire)
        if cuda:
            torch.cuda.synchronize()
        rows.append([time.perf_counter() - t0, 0.0, 0.0, 0.0, 0.0, time.process_time() - c0])
    return rows


def over_ranks(rows: Sequence[Sequence[float]], world_size: int, device: str) -> list[list[float]]:
    """Per step, the first column's max over ranks (a step is as slow as its slowest rank)
    and the other columns' mean over ranks. Every rank must call it (two all-reduces)."""
    # On the ranks' device: NCCL reduces CUDA tensors only.
    figures = torch.tensor(rows, dtype=torch.float64, device=device)
    slowest = figures[:, :1].clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    mean = figures[:, 1:].clone()
    dist.all_reduce(mean)
    mean /= world_size
    return torch.cat([slowest, mean], dim=1).tolist()


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
