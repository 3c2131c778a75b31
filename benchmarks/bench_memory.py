"""The engine benchmark's peak-memory runs: one system in a fresh pair of processes.

A process's peak resident set size only ever grows, so each (model, system) is measured in
new processes: ``measure_model_memory`` runs ``measure_memory`` in ``repeats`` fresh pairs
per system, interleaved, and keeps the median. On CUDA the figure is what torch's allocator
hands out. ``bench_engine.py`` is the command line; see ``docs/benchmarks.md``.
"""

from __future__ import annotations

import resource
import statistics
from typing import Any

import torch
import torch.distributed as dist

from bench_harness import (
    LR,
    MOMENTUM,
    RANKS_TIMEOUT,
    SYSTEMS,
    Config,
    make_batches,
    round_order,
    run_ranks,
    train_steps,
    wrap,
)
from models import MODELS


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
            ranks = run_ranks(
                measure_memory, 2, name, s, cfg, timeout=RANKS_TIMEOUT, backend=backend
            )
            worst = max(ranks, key=lambda m: m["delta_mb"])
            runs[s].append({**worst, "per_rank_delta_mb": [m["delta_mb"] for m in ranks]})
    out = {}
    for s, pairs in runs.items():
        deltas = [p["delta_mb"] for p in pairs]
        median = statistics.median(deltas)
        middle = min(pairs, key=lambda p: abs(p["delta_mb"] - median))
        out[s] = {**middle, "delta_mb": median, "repeats_delta_mb": deltas}
    return out
