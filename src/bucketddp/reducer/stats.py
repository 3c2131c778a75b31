"""What the reducer reports about its communication."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommStats:
    """Figures of the last synced backward pass."""

    collectives: int = 0
    """Collectives launched for the step's gradients: one per bucket, one per sparse
    gradient, and one for the agreement row under a communication hook."""
    bytes_reduced: int = 0
    """Bytes of gradient (and bookkeeping) all-reduced."""
    wait_seconds: float = 0.0
    """Time spent at the end of backward waiting for communication to finish."""
    buckets: int = 0
    """Buckets in the plan used for the step."""
