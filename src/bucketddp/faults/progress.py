"""Where this process is in training, as cheap marks the watchdog reads from its thread.

The wrapper marks a few points of each step (buffer sync, forward, back to user code) and the
strategy marks checkpoints and its own collectives. A mark is two attribute writes and a
clock read, so the per-step cost does not show; the watchdog thread reads the marks (and
the reducer's state, for the backward) to tell how long this rank has made no progress and
whether it is waiting on the other ranks meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

FORWARD = "forward"
BUFFER_SYNC = "buffer sync"
USER_CODE = "user code"  # after a forward: loss, backward, optimizer step, data
CHECKPOINT = "checkpoint"
COLLECTIVE = "collective"
STARTING = "starting"

# Phases in which this rank is inside a collective, so a long stay means it waits for
# another rank. The backward is told from the reducer's state instead, and a forward is
# not one: the collectives inside it (buffer sync, SyncBatchNorm) are marked on their own.
WAITING = frozenset({BUFFER_SYNC, COLLECTIVE})


_WORDS = {
    STARTING: "setting up, before its first forward",
    FORWARD: "in the model's forward (under Lightning: the training step)",
    BUFFER_SYNC: "syncing buffers before the forward",
    USER_CODE: "outside bucketddp, in user code (loss, optimizer step, data loading...)",
    CHECKPOINT: "writing a checkpoint",
    COLLECTIVE: "in a collective",
}


def describe(phase: str, detail: str = "") -> str:
    """What a rank in ``phase`` is doing, in words."""
    words = _WORDS.get(phase, phase)
    return f"{words}: {detail}" if detail else words


class Progress:
    """The last mark of this process: its phase, the training step and when."""

    __slots__ = ("detail", "phase", "since", "step")

    def __init__(self) -> None:
        self.phase = STARTING
        self.detail = ""
        self.step = 0
        self.since = time.monotonic()

    def mark(self, phase: str, detail: str = "") -> None:
        """This process entered ``phase`` now."""
        self.phase = phase
        self.detail = detail
        self.since = time.monotonic()

    def new_run(self) -> None:
        """A new watchdog starts watching: its run's steps count from 1 again."""
        self.step = 0

    def forward(self) -> None:
        """A training (grad-enabled) forward begins: the next step."""
        self.step += 1
        self.mark(FORWARD)

    @contextmanager
    def during(self, phase: str, detail: str = "") -> Iterator[None]:
        """Mark ``phase`` for the duration of the block, then the phase before it again."""
        before = self.phase, self.detail
        self.mark(phase, detail)
        try:
            yield
        finally:
            self.mark(*before)

    def idle(self) -> float:
        """Seconds since the last mark."""
        return time.monotonic() - self.since


PROGRESS = Progress()
"""The process's progress: one per process, as the watchdog is."""
