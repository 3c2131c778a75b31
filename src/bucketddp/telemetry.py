"""Communication telemetry for any loop: step figures to log, and a Chrome-trace timeline.

``CommLog`` turns a wrapper's ``comm_stats`` into a dict of figures every N steps, for any
logger (``print``, ``wandb.log``, ``fabric.log_dict``); the Lightning callback
``bucketddp.CommMonitor`` is built on it. ``Timeline`` records every bucket of N steps on
every rank and writes one Chrome-trace JSON on rank 0, for chrome://tracing or Perfetto.
Nothing here communicates except ``Timeline.export``, which gathers once, at the end.
See ``docs/telemetry.md``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from .buckets import BucketPlan
from .comm import global_rank
from .reducer.stats import CommStats


class Wrapped(Protocol):
    """What telemetry reads of a wrapper (``BucketDataParallel``)."""

    @property
    def comm_stats(self) -> CommStats:
        """The last synced backward's figures."""
        ...

    @property
    def bucket_plan(self) -> BucketPlan:
        """The buckets in launch order."""
        ...


def comm_metrics(stats: CommStats, prefix: str = "comm/") -> dict[str, float]:
    """One synced step's figures, in milliseconds, bytes and bytes per second."""
    return {
        f"{prefix}total_ms": stats.comm_seconds * 1e3,
        f"{prefix}hidden_ms": stats.hidden_seconds * 1e3,
        f"{prefix}exposed_wait_ms": stats.wait_seconds * 1e3,
        f"{prefix}hidden_fraction": stats.hidden_fraction,
        f"{prefix}bytes": float(stats.bytes_reduced),
        f"{prefix}bytes_per_s": stats.bytes_per_second,
        f"{prefix}buckets": float(stats.buckets),
        f"{prefix}collectives": float(stats.collectives),
    }


def plan_summary(plan: BucketPlan, prefix: str = "bucketddp/") -> dict[str, Any]:
    """The bucket plan as loggable values (hyperparameters): counts, sizes, the plan text."""
    return {
        f"{prefix}buckets": len(plan),
        f"{prefix}bucket_mb": [round(b.nbytes / 2**20, 3) for b in plan],
        f"{prefix}gradient_bytes": sum(b.nbytes for b in plan),
        f"{prefix}learned_order": plan.learned,
        f"{prefix}plan": plan.describe(),
    }


def check_every_n_steps(every_n_steps: object) -> None:
    """Raise unless ``every_n_steps`` is a positive int."""
    if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int):
        raise TypeError(f"every_n_steps must be an int, got {every_n_steps!r}")
    if every_n_steps < 1:
        raise ValueError(f"every_n_steps must be at least 1, got {every_n_steps}")


class CommLog:
    """Every ``every_n_steps`` synced steps, the median figures of those steps.

    Call ``step()`` once per optimizer step, after the backward; it returns None, or every
    N synced steps a dict of the medians of their ``comm_metrics`` and of ``step_ms`` (the
    time since the call before). A step whose backward did not sync (``no_sync``) adds
    nothing, and the first call only starts the clock. Example::

        log = CommLog(model, every_n_steps=50)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            opt.step(); opt.zero_grad()
            if (figures := log.step()) is not None:
                print(figures)           # or wandb.log(figures), fabric.log_dict(figures)
    """

    def __init__(self, model: Wrapped, every_n_steps: int = 50, prefix: str = "comm/") -> None:
        check_every_n_steps(every_n_steps)
        self.model = model
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self._seen: list[dict[str, float]] = []
        self._last: CommStats | None = None
        self._clock: float | None = None

    def step(self) -> dict[str, float] | None:
        """Note this step; every N steps, the figures' medians over them (else None).

        The first call only starts the clock: each step counted is timed from the call
        before it, so that its figures and its time belong together.
        """
        now = time.perf_counter()
        stats = self.model.comm_stats
        last, self._last = self._last, stats
        clock, self._clock = self._clock, now
        if clock is None or stats is last or not stats.bucket_timings:
            return None
        self._seen.append({**comm_metrics(stats, self.prefix), "step_ms": (now - clock) * 1e3})
        if len(self._seen) < self.every_n_steps:
            return None
        seen, self._seen = self._seen, []
        return {
            (key if key != "step_ms" else f"{self.prefix}step_ms"): statistics.median(
                s[key] for s in seen
            )
            for key in seen[0]
        }


class Timeline:
    """Every bucket of ``steps`` synced steps on every rank, as one Chrome-trace JSON.

    Call ``step()`` once per optimizer step on every rank. Once ``steps`` synced steps were
    recorded, every rank sends its records to rank 0 (one gather, a collective: every rank
    must reach it), which writes ``path``. Each rank is a process in the trace, with a lane
    per bucket (the collective, from launch to completion) and a lane for the end of
    backward (the exposed wait); each bucket's arrival of its last gradient is a mark.
    """

    def __init__(self, model: Wrapped, path: str | Path, steps: int = 5, group: Any = None) -> None:
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        self.model = model
        self.path = Path(path)
        self.steps = steps
        self.group = group
        self.done = False
        self._records: list[CommStats] = []
        self._last: CommStats | None = None
        # perf_counter() to wall clock, so that the ranks' times line up in the trace.
        self._offset = time.time() - time.perf_counter()

    def step(self) -> bool:
        """Record this step; returns True once the timeline was written (rank 0) or sent."""
        if self.done:
            return True
        stats = self.model.comm_stats
        if stats is not self._last and stats.bucket_timings:
            self._records.append(stats)
        self._last = stats
        if len(self._records) >= self.steps:
            self.export()
        return self.done

    def export(self) -> None:
        """Gather every rank's records on rank 0 and write the trace there (a collective)."""
        rank = dist.get_rank(self.group)
        mine = trace_events(self._records, self._offset, rank)
        everyone: list[Any] | None = [None] * dist.get_world_size(self.group) if rank == 0 else None
        dist.gather_object(mine, everyone, dst=global_rank(self.group), group=self.group)
        if everyone is not None:
            events = [e for rank_events in everyone for e in (rank_events or [])]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        self.done = True


def trace_events(records: Sequence[CommStats], offset: float, rank: int) -> list[dict[str, Any]]:
    """Chrome-trace events of one rank's steps (times in microseconds of wall clock)."""

    def us(t: float) -> float:
        return round((t + offset) * 1e6, 1)

    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
        {
            "name": "thread_name",
            "ph": "M",
            "pid": rank,
            "tid": 0,
            "args": {"name": "end of backward"},
        },
    ]
    lanes: set[int] = set()
    for step, stats in enumerate(records):
        for t in stats.bucket_timings:
            tid = t.index + 1
            if tid not in lanes:
                lanes.add(tid)
                events.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": rank,
                        "tid": tid,
                        "args": {"name": f"bucket {t.index}"},
                    }
                )
            args = {"step": step, "bytes": t.nbytes, "ready_us": us(t.ready)}
            events.append(
                {
                    "name": f"bucket {t.index} all-reduce",
                    "cat": "bucketddp",
                    "ph": "X",
                    "pid": rank,
                    "tid": tid,
                    "ts": us(t.launched),
                    "dur": round((t.completed - t.launched) * 1e6, 1),
                    "args": args,
                }
            )
            events.append(
                {
                    "name": f"bucket {t.index} ready",
                    "cat": "bucketddp",
                    "ph": "i",
                    "s": "t",
                    "pid": rank,
                    "tid": tid,
                    "ts": us(t.ready),
                }
            )
        events.append(
            {
                "name": "wait for buckets",
                "cat": "bucketddp",
                "ph": "X",
                "pid": rank,
                "tid": 0,
                "ts": us(stats.wait_started),
                "dur": round(stats.wait_seconds * 1e6, 1),
                "args": {"step": step, "hidden_ms": stats.hidden_seconds * 1e3},
            }
        )
    return events
