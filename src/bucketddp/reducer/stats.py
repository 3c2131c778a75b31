"""What the reducer reports about its communication: per step, and per bucket."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketTiming:
    """When one bucket of a synced backward went through its stages.

    Times are ``time.perf_counter()`` seconds of this process. ``completed`` is when the
    reducer saw the collective done, at a later bucket's launch or as the end of backward
    began to wait; for one still running then, and for the last bucket, when the end of
    backward finished waiting for it.
    """

    index: int
    """The bucket's place in the plan (launch order)."""
    nbytes: int
    """Bytes on the wire: the bucket's storage, agreement row included."""
    ready: float
    """When its last gradient arrived."""
    launched: float
    """When its collective was launched (after every earlier bucket's, in plan order)."""
    completed: float
    """When its collective completed."""
    waited: float
    """When the end of backward was done waiting for it."""


@dataclass(frozen=True)
class CommStats:
    """Figures of the last synced backward pass."""

    collectives: int = 0
    """Collectives launched for the step's gradients: one per bucket, one per sparse
    gradient, and one for the agreement row under a communication hook."""
    bytes_reduced: int = 0
    """Bytes of gradient (and bookkeeping) all-reduced."""
    wait_seconds: float = 0.0
    """The exposed wait: time spent at the end of backward waiting for communication."""
    buckets: int = 0
    """Buckets in the plan used for the step."""
    comm_seconds: float = 0.0
    """Time during which at least one bucket's collective was in flight, or the end of
    backward waited for one: so ``wait_seconds <= comm_seconds``."""
    hidden_seconds: float = 0.0
    """The part of ``comm_seconds`` before the end of backward began to wait: hidden
    under the backward pass."""
    wait_started: float = 0.0
    """When the end of backward began to wait (``time.perf_counter()``)."""
    bucket_timings: tuple[BucketTiming, ...] = ()
    """Each bucket's stages, in launch order."""

    @property
    def bytes_per_second(self) -> float:
        """Achieved bandwidth: ``bytes_reduced`` over ``comm_seconds`` (0 if nothing ran)."""
        return self.bytes_reduced / self.comm_seconds if self.comm_seconds > 0 else 0.0

    @property
    def hidden_fraction(self) -> float:
        """``hidden_seconds / comm_seconds``: how much of the communication overlapped."""
        return self.hidden_seconds / self.comm_seconds if self.comm_seconds > 0 else 0.0


def overlap(spans: Sequence[tuple[float, float]], until: float) -> tuple[float, float]:
    """(length of the union of ``spans``, the part of that union before ``until``)."""
    total = hidden = 0.0
    end = float("-inf")
    for start, stop in sorted(spans):
        start = max(start, end)
        if stop <= start:
            continue
        total += stop - start
        hidden += max(0.0, min(stop, until) - start)
        end = stop
    return total, hidden
