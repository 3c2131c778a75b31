"""Several training loaders in one fit: where each one stands in an epoch, to resume there.

Lightning combines a fit's training loaders (a dict or list from ``train_dataloader``) in a
``CombinedLoader`` that yields a batch of each per step. In its default mode for training,
``max_size_cycle``, an epoch lasts as long as its longest loader, and a shorter one starts
over whenever it runs out, within the epoch. So once ``k`` batches of an epoch are done, a
loader of ``n`` batches a pass is ``(k - 1) % n + 1`` batches into its current pass. In
``max_size`` a loader that ran out yields nothing more, and in ``min_size`` the epoch ends
with the shortest: there a loader is ``min(k, n)`` batches in. ``sequential`` (one loader
after the other) is not followed.

Each loader's ``ElasticSampler`` resumes at its own position for its current pass only
(``resume(..., once=True)``): later passes in that epoch are whole, as in the fit that went
on. That is exact at an unchanged world size; at another one the loaders' passes no longer
line up with the epoch's batches, and a fit with several loaders starts each pass whole.

Nothing here imports Lightning: ``bucketddp.lightning.trainer_elastic`` asks Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .sampler import ElasticSampler

CYCLING = "max_size_cycle"
FOLLOWED = (CYCLING, "max_size", "min_size")
"""The modes of a combined loader whose loaders' positions are followed."""


def batches_in(processed: int, batches: int, mode: str) -> int:
    """How many batches of its current pass a loader of ``batches`` a pass has given once
    the epoch's first ``processed`` batches are done, in a combined loader of ``mode``."""
    if mode == CYCLING and batches > 0 and processed > 0:
        return (processed - 1) % batches + 1
    return min(processed, batches)


@dataclass
class TrainingLoader:
    """One training loader of the fit: its sampler (None: not an ``ElasticSampler``), its
    batch size, its batches a pass, and whether it has worker processes."""

    sampler: ElasticSampler | None
    batch_size: int
    batches: int
    workers: bool


class TrainingLoaders:
    """A fit's training loaders, in the combined loader's order, as the strategy saw them.

    ``add`` is called for each one in that order each time Lightning sets them up (at the
    fit's start, and again for ``reload_dataloaders_every_n_epochs``); once ``count`` is
    known (the fit's loop has started), an ``add`` after the last one starts the list anew.
    """

    def __init__(self) -> None:
        self.loaders: list[TrainingLoader] = []
        self.count: int | None = None
        self.mode = CYCLING

    def add(self, loader: TrainingLoader) -> int:
        """Register the next loader of the set; returns its index."""
        if self.count is not None and len(self.loaders) >= self.count:
            self.loaders = []
        self.loaders.append(loader)
        return len(self.loaders) - 1

    def started(self, count: int, mode: str) -> None:
        """The fit's loop started with ``count`` training loaders combined in ``mode``."""
        self.count, self.mode = count, mode

    @property
    def several(self) -> bool:
        """Whether the fit trains on more than one loader."""
        return (self.count or len(self.loaders)) > 1

    def followed(self) -> bool:
        """Whether each loader's position can be kept: every one has an ``ElasticSampler``
        and the combined loader's mode is one whose positions are known."""
        return (
            self.mode in FOLLOWED
            and len(self.loaders) == (self.count or len(self.loaders))
            and all(x.sampler is not None for x in self.loaders)
        )

    def positions(self, processed: int) -> list[dict[str, Any]]:
        """Each loader's entry for a snapshot taken once ``processed`` batches of the epoch
        are done: its position, and the samples it used of its current pass."""
        entries = []
        for x in self.loaders:
            assert x.sampler is not None
            used = batches_in(processed, x.batches, self.mode) * x.batch_size
            entries.append({"position": x.sampler.position(used), "used": used})
        return entries

    def first_fetch(self) -> int:
        """The loader whose sampler is asked for its first index once every loader's
        iterator is made and before any batch is fetched in this process: the last one if
        it has worker processes (which ask as their iterator is made), else the first one
        without (which asks as the first batch is fetched)."""
        if self.loaders[-1].workers:
            return len(self.loaders) - 1
        return next(i for i, x in enumerate(self.loaders) if not x.workers)
