"""``bucket_cap_mb="auto"``: try bucket sizes on real steps, keep the fastest.

Once the learned order is in place (after the first synced backward), the tuner plans the
buckets with each candidate size in turn, one synced step each, for ``ROUNDS`` rounds, so
that a slow drift of the machine hits every candidate alike. A step's figure is the whole
step, from the end of the previous synced backward (after the rebuild for the candidate)
to the end of this one's wait. Then rank 0 takes the candidate with the lowest median,
unless it is less than ``MARGIN`` faster than the default, and broadcasts its
choice (one collective, once), and every rank plans by it from then on.

The steps spent tuning reduce every gradient as any step does: the sizes change when
communication happens, not what it computes. A ``join()`` context defers the choice (a rank
that ran out of data would miss the broadcast), so tuning waits for steps outside of one.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist

from ..buckets import MB, cap_bytes
from ..comm import global_rank
from .state import ReducerState

log = logging.getLogger("bucketddp.reducer")

ROUNDS = 3
MARGIN = 0.03
"""How much faster than the default (the first candidate) another must be to be chosen:
three steps each cannot tell apart candidates a few percent apart on a busy machine."""
"""Synced steps measured per candidate, one per round."""
DEFAULT = (25.0, 1.0)  # torch DDP's bucket_cap_mb and first_bucket_mb


def candidates(
    gradient_mb: float, cap_mb: float | None, first_mb: float | None
) -> list[tuple[float, float]]:
    """The (bucket_cap_mb, first_bucket_mb) pairs to try; None marks the size to tune.

    The default first, then one bucket for everything, then a half, a quarter and an
    eighth of the gradients; the first bucket stays 1 MB (or the cap, if smaller), unless
    it is tuned alone. Pairs that give the same buckets are tried once (``distinct``).
    """
    whole = gradient_mb + 1.0  # one bucket
    if cap_mb is None:
        caps = [DEFAULT[0], whole] + [gradient_mb / d for d in (2, 4, 8)]
        firsts = [first_mb] if first_mb is not None else [DEFAULT[1]]
    else:
        caps = [cap_mb]
        firsts = [DEFAULT[1], 0.25, 4.0, cap_mb] if first_mb is None else [first_mb]
    out: list[tuple[float, float]] = []
    for cap in caps:
        for first in firsts:
            pair = (round(cap, 3), round(min(first, cap) if cap != whole else cap, 3))
            if pair not in out:
                out.append(pair)
    return out


class BucketTuner:
    """Tries each candidate bucket size on real steps; rank 0 picks the fastest."""

    def __init__(self, r: ReducerState, cap_mb: float | None, first_mb: float | None) -> None:
        self._r = r
        self._sizes = cap_mb, first_mb  # None: tuned
        self._pairs: list[tuple[float, float]] = []
        self._samples: list[list[float]] = []
        self._step = 0
        self._since: float | None = None  # when the step being measured began
        self.choice: tuple[float, float] | None = None
        """The sizes chosen, in MB, once tuning is over."""
        self.medians: list[tuple[tuple[float, float], float]] = []
        """Each candidate with its median figure in seconds (rank 0's), once chosen."""

    @property
    def done(self) -> bool:
        """Whether the sizes are chosen (or adopted from a checkpoint)."""
        return self.choice is not None

    def after_step(self, joining: bool) -> None:
        """At the end of a synced step: record it, then plan the next candidate or choose."""
        now = time.perf_counter()
        r = self._r
        if self.choice is not None or r.observed is not None or joining:
            self._since = None  # a step that did not count: the next is not measured either
            return
        if not self._pairs:
            gradient_mb = sum(b.nbytes for b in r.plan) / MB
            self._pairs = self._distinct(candidates(gradient_mb, *self._sizes))
            self._samples = [[] for _ in self._pairs]
        elif self._since is not None:
            self._samples[(self._step - 1) % len(self._pairs)].append(now - self._since)
        if self._step == ROUNDS * len(self._pairs):
            self._choose()
            return
        self._use(self._pairs[self._step % len(self._pairs)])
        self._step += 1
        self._since = time.perf_counter()  # after the rebuild, which is not the plan's cost

    def _distinct(self, pairs: list[tuple[float, float]]) -> list[tuple[float, float]]:
        """The first of each group of pairs that plan the same buckets."""
        r = self._r
        seen: set[tuple[tuple[str, ...], ...]] = set()
        out = []
        for pair in pairs:
            plan = r.m.plan(cap_bytes(pair[0]), cap_bytes(pair[1]), r.plan.order)
            key = tuple(b.names for b in plan)
            if key not in seen:
                seen.add(key)
                out.append(pair)
        return out

    def adopt(self, cap_mb: float, first_mb: float) -> None:
        """Use sizes chosen before (a checkpoint's), without tuning."""
        self.choice = (cap_mb, first_mb)
        self._use(self.choice)

    def _use(self, pair: tuple[float, float]) -> None:
        self._r.use_caps((cap_bytes(pair[0]), cap_bytes(pair[1])))

    def _choose(self) -> None:
        r = self._r
        medians = [statistics.median(s) if s else float("inf") for s in self._samples]
        best = min(range(len(medians)), key=medians.__getitem__)
        if medians[best] > medians[0] * (1 - MARGIN):
            best = 0  # the default, unless another is clearly faster: not a coin toss
        if r.world_size > 1:
            device = r.device
            choice = torch.tensor([best], dtype=torch.int64, device=device)
            dist.broadcast(choice, src=global_rank(r.process_group), group=r.process_group)
            best = int(choice.item())
        self.medians = list(zip(self._pairs, medians, strict=True))
        self.choice = self._pairs[best]
        self._use(self.choice)
        log.info(
            "bucketddp: bucket sizes tuned: bucket_cap_mb=%g, first_bucket_mb=%g (rank 0's "
            "median ms per candidate: %s)",
            *self.choice,
            ", ".join(f"{c[0]:g}/{c[1]:g}: {m * 1e3:.2f}" for c, m in self.medians),
        )
