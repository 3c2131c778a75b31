"""What the reducer reports about its communication."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core import Reducer


@dataclass(frozen=True)
class CommStats:
    """Figures of the last synced backward pass."""

    collectives: int = 0
    """All-reduces launched for gradient buckets."""
    bytes_reduced: int = 0
    """Bytes of gradient (and bookkeeping) all-reduced."""
    wait_seconds: float = 0.0
    """Time spent at the end of backward waiting for communication to finish."""
    buckets: int = 0
    """Buckets in the plan used for the step."""


def step_stats(r: Reducer, waited: float) -> CommStats:
    """The figures of the step ``r`` just reduced, which waited ``waited`` seconds."""
    sparse = r.sparse
    return CommStats(
        collectives=len(r.buckets) + len(r.unslotted) + r.launcher.extra_collectives,
        bytes_reduced=r.storage.nbytes + (sparse.nbytes() if sparse is not None else 0),
        wait_seconds=waited,
        buckets=len(r.buckets),
    )
