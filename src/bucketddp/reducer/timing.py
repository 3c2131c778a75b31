"""The clock of a step's buckets, for ``CommStats``: ready, launched, completed, waited.

The core stamps ``Bucket.ready_at`` when a bucket's last gradient arrives and tells the
clock each launch; ``Bucket.wait`` stamps ``waited_at``. A bucket's completion is when the
clock sees its collective done: it asks at each later launch and when the end of backward
begins to wait; one still running then completes at the end of its wait. The last bucket's
is the end of its wait, which begins as soon as it is launched. A callback on the
collective's future would be exact, but the backend runs it on its own thread, which must
take the GIL from the backward's hooks: measured on a 2-bucket MLP of 1.2 MB on gloo, about
0.15 ms more per step of 5 ms, most of bucketddp's gap to torch DDP there. Under
the PyTorch profiler each bucket's collective is also a named range from its launch to its
completion. Nothing here waits or synchronizes a device.

At the end of a step the clock only keeps what it read (``finish``); the ``CommStats`` is
built from it when someone asks (``last``), since most steps' figures are never read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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
        self._last: CommStats | None = CommStats()
        self._kept: tuple[Any, ...] = ()  # what the last step's figures are built from
        self._running: list[tuple[int, Callable[[], bool]]] = []  # not seen done yet

    def launched(self, k: int, work: Any, *, last: bool = False) -> None:
        """Bucket ``k``'s collective was just launched; ``work`` is what to wait on.

        The earlier buckets seen done by now complete now. The ``last`` bucket is not
        watched: it is launched at the end of the backward and waited for at once, so its
        wait's end is its completion.
        """
        now = time.perf_counter()
        if k == 0:  # a new step
            n = len(self._launched)
            self._launched = [0.0] * n
            self._completed = [0.0] * n
            self._running = []
        if len(self._launched) <= k:  # a longer plan than the last step's
            grow = [0.0] * (k + 1 - len(self._launched))
            self._launched += grow
            self._completed += grow
        if self._running:
            self._seen_done(now)
        self._launched[k] = now
        if not last:
            done = getattr(work, "is_completed", None) or getattr(work, "done", None)
            if done is not None:
                self._running.append((k, done))
        if profiler._is_profiler_enabled:
            future = work.get_future() if hasattr(work, "get_future") else work
            if not hasattr(future, "add_done_callback"):
                return
            record = profiler.record_function(f"bucketddp: bucket {k} all-reduce")
            record.__enter__()
            record._call_end_callbacks_on_future(future)

    def _seen_done(self, now: float) -> None:
        """Stamp ``now`` as the completion of every watched bucket that is done."""
        running = []
        for k, done in self._running:
            if done():
                self._completed[k] = now
            else:
                running.append((k, done))
        self._running = running

    def wait_begins(self) -> float:
        """The end of backward begins to wait; returns the time."""
        now = time.perf_counter()
        if self._running:
            self._seen_done(now)
        self.wait_started = now
        return now

    def finish(self, plan: Sequence[Bucket], /, **figures: Any) -> None:
        """The step is over: keep what its ``CommStats`` will be built from, with ``figures``
        (collectives, bytes, ...)."""
        times = [(b.ready_at, b.waited_at, b.storage.nbytes) for b in plan]
        self._kept = (times, self._launched, self._completed, self.wait_started, figures)
        self._running = []  # every bucket was waited for: nothing left to watch
        self._last = None

    def last(self) -> CommStats:
        """``CommStats`` of the last finished step."""
        if self._last is None:
            self._last = self._build(*self._kept)
        return self._last

    @staticmethod
    def _build(
        times: list[tuple[float, float, int]],
        launched: list[float],
        completed: list[float],
        wait_started: float,
        figures: dict[str, Any],
    ) -> CommStats:
        timings = []
        for k, (ready_at, waited_at, nbytes) in enumerate(times):
            if k >= len(launched) or not launched[k]:
                continue
            waited = waited_at or wait_started
            done = completed[k] or waited
            timings.append(
                BucketTiming(
                    index=k,
                    nbytes=nbytes,
                    ready=min(ready_at or launched[k], launched[k]),
                    launched=launched[k],
                    completed=min(done, waited),
                    waited=waited,
                )
            )
        # The wait itself counts as communication: the main thread may notice a completion
        # late (a busy core, the GIL), and the exposed wait is the step's to pay either way.
        spans = [(t.launched, t.completed) for t in timings]
        if timings:
            spans.append((wait_started, wait_started + figures["wait_seconds"]))
        comm, hidden = overlap(spans, wait_started)
        return CommStats(
            comm_seconds=comm,
            hidden_seconds=hidden,
            wait_started=wait_started,
            bucket_timings=tuple(timings),
            **figures,
        )


class NoClock(StepClock):
    """``telemetry=False``: the step totals only, no per-bucket times."""

    def launched(self, k: int, work: Any, *, last: bool = False) -> None:
        """Nothing to record."""

    def finish(self, plan: Sequence[Bucket], /, **figures: Any) -> None:
        """The step is over: keep its ``figures`` alone."""
        self._kept = (self.wait_started, figures)
        self._last = None

    def last(self) -> CommStats:
        """``CommStats`` with the last step's figures alone."""
        if self._last is None:
            wait_started, figures = self._kept
            self._last = CommStats(wait_started=wait_started, **figures)
        return self._last
