"""The clock of a step's buckets, for ``CommStats``: ready, launched, completed, waited.

The core stamps ``Bucket.ready_at`` when a bucket's last gradient arrives and tells the
clock each launch; ``Bucket.wait`` stamps ``waited_at``. Completion comes from a callback
on the collective's future, run by the backend when it finishes (gloo's thread). Under
the PyTorch profiler each bucket's collective is also a named range from its launch to its
completion. Nothing here waits or synchronizes a device.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

from torch.autograd import profiler

from .stats import BucketTiming, CommStats, overlap
from .storage import Bucket


class StepClock:
    """The times of the buckets of the synced backward under way."""

    def __init__(self) -> None:
        self._launched: list[float] = []
        self._completed: list[float] = []
        self.wait_started = 0.0

    def launched(self, k: int, work: Any) -> None:
        """Bucket ``k``'s collective was just launched; ``work`` is what to wait on."""
        if k == 0:  # a new step: new lists, as a late completion may still write the old
            n = len(self._launched)
            self._launched = [0.0] * n
            self._completed = [0.0] * n
        if len(self._launched) <= k:  # a longer plan than the last step's
            grow = [0.0] * (k + 1 - len(self._launched))
            self._launched += grow
            self._completed += grow
        self._launched[k] = time.perf_counter()
        future = work.get_future() if hasattr(work, "get_future") else work
        if not hasattr(future, "add_done_callback"):
            return
        future.add_done_callback(functools.partial(self._complete, self._completed, k))
        if profiler._is_profiler_enabled:
            record = profiler.record_function(f"bucketddp: bucket {k} all-reduce")
            record.__enter__()
            record._call_end_callbacks_on_future(future)

    @staticmethod
    def _complete(completed: list[float], k: int, _future: Any) -> None:
        completed[k] = time.perf_counter()

    def wait_begins(self) -> float:
        """The end of backward begins to wait; returns the time."""
        self.wait_started = time.perf_counter()
        return self.wait_started

    def stats(self, plan: Sequence[Bucket], /, **figures: Any) -> CommStats:
        """``CommStats`` of the step, with ``figures`` (collectives, bytes, ...)."""
        timings = []
        for k, bucket in enumerate(plan):
            if k >= len(self._launched) or not self._launched[k]:
                continue
            waited = bucket.waited_at or self.wait_started
            completed = self._completed[k] or waited
            timings.append(
                BucketTiming(
                    index=k,
                    nbytes=bucket.storage.numel() * bucket.storage.element_size(),
                    ready=min(bucket.ready_at or self._launched[k], self._launched[k]),
                    launched=self._launched[k],
                    completed=min(completed, waited),
                    waited=waited,
                )
            )
        # The wait itself counts as communication: the main thread may notice a completion
        # late (a busy core, the GIL), and the exposed wait is the step's to pay either way.
        spans = [(t.launched, t.completed) for t in timings]
        if timings:
            spans.append((self.wait_started, self.wait_started + figures["wait_seconds"]))
        comm, hidden = overlap(spans, self.wait_started)
        return CommStats(
            comm_seconds=comm,
            hidden_seconds=hidden,
            wait_started=self.wait_started,
            bucket_timings=tuple(timings),
            **figures,
        )


class NoClock(StepClock):
    """``telemetry=False``: the step totals only, no per-bucket times."""

    def launched(self, k: int, work: Any) -> None:
        """Nothing to record."""

    def stats(self, plan: Sequence[Bucket], /, **figures: Any) -> CommStats:
        """``CommStats`` with ``figures`` alone."""
        return CommStats(wait_started=self.wait_started, **figures)
