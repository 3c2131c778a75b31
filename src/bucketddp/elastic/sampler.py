"""``ElasticSampler``: DistributedSampler's order, resumable mid-epoch at any world size.

An epoch's order is the one torch's ``DistributedSampler`` gives: a permutation seeded by
``seed + epoch``, padded (or cut, with ``drop_last``) to a multiple of the world size, rank
``r`` taking every ``world_size``-th index from ``r``. After ``k`` samples per rank, the
ranks together have used the first ``k * world_size`` indices of that order; the rest of
the epoch is the order from there. ``resume`` restarts an epoch at such an offset, at the
same world size (the ranks then see exactly what they would have seen) or at another one
(what is left is split over the new ranks, padded or cut as ``DistributedSampler`` does),
so no sample is lost or taken twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DistributedSampler


@dataclass(frozen=True)
class EpochPosition:
    """Where an epoch stands: ``offset`` indices of its order (for ``base_world`` ranks)
    are used up."""

    epoch: int
    base_world: int
    offset: int


def same_order(like: DistributedSampler[Any]) -> dict[str, Any]:
    """``like``'s arguments but its dataset: an ``ElasticSampler`` made with them (and the
    same dataset) draws ``like``'s order."""
    return {
        "num_replicas": like.num_replicas,
        "rank": like.rank,
        "shuffle": like.shuffle,
        "seed": like.seed,
        "drop_last": like.drop_last,
    }


def epoch_order(
    size: int, world: int, epoch: int, seed: int, shuffle: bool, drop_last: bool
) -> list[int]:
    """The global order of one epoch, before it is dealt to ``world`` ranks."""
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(size, generator=g).tolist()
    else:
        order = list(range(size))
    return _fit(order, world, drop_last, wrap=order)


def _fit(order: list[int], world: int, drop_last: bool, wrap: list[int]) -> list[int]:
    """``order`` padded from ``wrap`` (or cut) to a multiple of ``world``, as torch does."""
    if drop_last:
        return order[: len(order) - len(order) % world]
    pad = -len(order) % world
    if pad and wrap:
        order = order + (wrap * math.ceil(pad / len(wrap)))[:pad]
    return order


class ElasticSampler(DistributedSampler):
    """A ``DistributedSampler`` that can resume an epoch where it stopped, at any world size.

    Takes ``DistributedSampler``'s arguments and gives its order. ``position(used)`` says
    where the epoch stands once each rank has used ``used`` samples of it; after a restart,
    ``resume(position, used)`` makes the epoch continue from there: ``used`` is how many
    samples per rank the caller counts as done in that epoch (its later ``position``
    calls count from the epoch's start, those included). ``len()`` is always a whole
    epoch's share at this world size. ``before_first``, if set, is called once, as the next
    iteration is asked for its first index (or finds it has none).
    """

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self._resumed: tuple[EpochPosition, int] | None = None
        # What ``resume`` was given, kept for ``position`` after a ``once`` pass began.
        self._kept: tuple[EpochPosition, int] | None = None
        # The shards last made: the next pass's, and the resumed one's for ``position``.
        self._cached: dict[tuple[Any, ...], list[int]] = {}
        self._once = False
        self.before_first: Callable[[], None] | None = None

    def _order(self, world: int) -> list[int]:
        size = len(self.dataset)  # type: ignore[arg-type]
        return epoch_order(size, world, self.epoch, self.seed, self.shuffle, self.drop_last)

    def _here(
        self, resumed: tuple[EpochPosition, int] | None
    ) -> tuple[EpochPosition, int] | None:
        return resumed if resumed is not None and resumed[0].epoch == self.epoch else None

    def _resumed_here(self) -> tuple[EpochPosition, int] | None:
        return self._here(self._resumed)

    def _shard(self, resumed: tuple[EpochPosition, int] | None = None) -> list[int]:
        """This rank's indices of the pass ``resumed`` continues (default: the next pass)."""
        resumed = self._resumed_here() if resumed is None else self._here(resumed)
        key = (self.epoch, resumed, self.num_replicas, self.rank)
        if key in self._cached:
            return self._cached[key]
        if resumed is None:
            shard = self._order(self.num_replicas)[self.rank :: self.num_replicas]
        else:
            position, _ = resumed
            left = self._order(position.base_world)[position.offset :]
            left = _fit(left, self.num_replicas, self.drop_last, wrap=left)
            shard = left[self.rank :: self.num_replicas]
        if len(self._cached) > 1:
            self._cached.clear()
        self._cached[key] = shard
        return shard

    def __iter__(self) -> Iterator[int]:
        # A generator: ``before_first`` runs as the first index is asked for, not at
        # ``iter()``. A loader may make an iterator it never uses (torchdata's
        # StatefulDataLoader makes its sampler's at once), and draws its own seed around it.
        call, self.before_first = self.before_first, None
        if call is not None:
            call()
        shard = self._shard()
        if self._once and self._resumed_here() is not None:
            self._resumed = None  # this pass goes on where it stopped; a later one is whole
        yield from shard

    def __len__(self) -> int:
        # A whole epoch's share at this world size, resumed or not: a loop that counts the
        # epoch's batches (Lightning) gets the same length every epoch, and a resumed epoch,
        # shorter, ends when its samples run out.
        return int(self.num_samples)

    def left(self) -> int:
        """The samples this rank has to go in a resumed epoch (a whole epoch's share if the
        epoch is not resumed)."""
        return len(self._shard())

    def position(self, used: int, *, later_pass: bool = False) -> EpochPosition:
        """Where this epoch stands once each rank has used ``used`` samples of it (counted
        from the epoch's start, resumed samples included).

        ``later_pass``: ``used`` counts in a whole pass after the resumed one (``once``);
        otherwise it counts in the resumed pass, even once a loader running ahead has
        begun the next one.
        """
        resumed = None if later_pass else self._here(self._kept)
        if resumed is None:
            used = min(used, int(self.num_samples))
            return EpochPosition(self.epoch, self.num_replicas, used * self.num_replicas)
        position, skipped = resumed
        new = min(max(used - skipped, 0), len(self._shard(resumed)))
        return EpochPosition(
            self.epoch, position.base_world, position.offset + new * self.num_replicas
        )

    def resume(self, position: EpochPosition, used: int, *, once: bool = False) -> None:
        """Continue ``position``'s epoch from there; ``used``: samples per rank the caller's
        progress counts as done in that epoch.

        ``once``: only the next pass over the sampler goes on from there; a later pass in
        the same epoch is whole (a loader that a combined loader starts over when it runs
        out, within an epoch). Its ``position`` then counts from that pass's start, which
        is the same offset at an unchanged world size.
        """
        self.set_epoch(position.epoch)
        self._resumed = self._kept = (position, used)
        self._once = once
