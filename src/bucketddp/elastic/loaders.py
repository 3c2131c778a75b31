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
on. At another world size, what is left of each loader's pass is split over the new ranks,
so its passes no longer begin where the epoch's batch count says: each loader keeps where
its current pass began (``TrainingLoader.start``), and the epoch goes on for as many batches
as the rows left of the loader that ends it make (``TrainingLoaders.epoch_rest``).

Nothing here imports Lightning: ``bucketddp.lightning.trainer_loaders`` asks Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .sampler import ElasticSampler, EpochPosition

CYCLING = "max_size_cycle"
FOLLOWED = (CYCLING, "max_size", "min_size")
"""The modes of a combined loader whose loaders' positions are followed."""


def batches_in(processed: int, batches: int, mode: str, start: tuple[int, int] = (0, 0)) -> int:
    """How many batches of its current pass a loader of ``batches`` a pass has given once
    the epoch's first ``processed`` batches are done, in a combined loader of ``mode``.

    ``start``: once ``start[0]`` batches of the epoch were done, the loader was ``start[1]``
    batches into a pass (an epoch resumed at another world size); by default its first pass
    began with the epoch.
    """
    done, into = start
    k = max(processed - done, 0)
    if _later_pass(k, batches, into, mode):
        return (k - (batches - into) - 1) % batches + 1
    return min(into + k, batches)


def batches_left(samples: int, batch_size: int, drop_last: bool) -> int:
    """The batches ``samples`` samples left make (a short last one dropped if ``drop_last``)."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


def _later_pass(k: int, batches: int, into: int, mode: str) -> bool:
    """Whether ``k`` batches after a point ``into`` batches into a pass, a loader is in a
    later pass (it starts over when it runs out: ``max_size_cycle``)."""
    return mode == CYCLING and batches > 0 and k > batches - into


@dataclass
class TrainingLoader:
    """One training loader of the fit: its sampler (None: not an ``ElasticSampler``), its
    batch size, its batches a pass, whether it has worker processes, and whether its last
    batch of a pass is dropped when short.

    ``start``, once resumed: (epoch, batches of that epoch done, batches into the loader's
    pass then). ``rest`` and ``ends``, resumed at another world size: the batches its pass
    has left at this one, and whether that pass ended the epoch in the fit that stopped.
    """

    sampler: ElasticSampler | None
    batch_size: int
    batches: int
    workers: bool
    drop_last: bool = False
    start: tuple[int, int, int] | None = None
    rest: int = 0
    ends: bool = True


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

    def epoch_batches(self) -> int:
        """The batches an epoch has at this world size, as Lightning counts them."""
        counts = [x.batches for x in self.loaders]
        return min(counts) if self.mode == "min_size" else max(counts)

    def positions(self, processed: int) -> list[dict[str, Any]]:
        """Each loader's entry for a snapshot taken once ``processed`` batches of the epoch
        are done: its position, the samples it used of its current pass, where the pass it
        resumed began (``start``), and whether its current pass ends with the epoch."""
        entries = []
        total = self.epoch_batches()
        for x in self.loaders:
            assert x.sampler is not None
            start = x.start[1:] if x.start and x.start[0] == x.sampler.epoch else (0, 0)
            batches = batches_in(processed, x.batches, self.mode, start)
            later = _later_pass(processed - start[0], x.batches, start[1], self.mode)
            used = batches * x.batch_size
            entries.append(
                {
                    "position": x.sampler.position(used, later_pass=later),
                    "used": used,
                    "start": start,
                    "ends": processed + x.batches - batches == total,
                }
            )
        return entries

    def resume(self, index: int, entry: dict[str, Any], resized: bool, ended: bool) -> None:
        """Resume loader ``index``'s sampler where its snapshot ``entry`` left its current
        pass; ``resized``: at another world size than the snapshot's, where the rest of that
        pass is split over this one's ranks (then call ``epoch_rest`` once all are).

        ``ended``: the snapshot was taken at the epoch's end, so nothing is left of it for
        any loader (Lightning before 2.5 runs that epoch again and must get no batch: in
        ``max_size_cycle`` a loader with rows left would give one).
        """
        x = self.loaders[index]
        assert x.sampler is not None
        position: EpochPosition = entry["position"]
        done, into = entry.get("start", (0, 0))
        if ended:
            world = x.sampler.num_replicas
            end = EpochPosition(position.epoch, world, x.sampler.total_size)
            x.sampler.resume(end, x.batches * x.batch_size, once=True)
            x.start, x.rest = (position.epoch, 0, 0), 0
            return
        if not resized:
            x.sampler.resume(position, entry["used"], once=True)
            x.start = (position.epoch, done, into)
            return
        x.sampler.resume(position, 0, once=True)
        x.rest = batches_left(x.sampler.left(), x.batch_size, x.drop_last)
        x.ends = bool(entry.get("ends", True))
        x.sampler.resume(position, (x.batches - x.rest) * x.batch_size, once=True)

    def epoch_rest(self) -> int:
        """Every loader resumed at another world size: the batches of the epoch to count as
        done, so that it ends when the rows left of the loader that ends it run out (each
        loader's ``start`` is set there)."""
        rests = [x.rest for x in self.loaders]
        if self.mode == "min_size":
            rest = min(rests)
        elif self.mode == CYCLING:
            rest = max((x.rest for x in self.loaders if x.ends), default=max(rests))
        else:
            rest = max(rests)
        done = self.epoch_batches() - rest
        for x in self.loaders:
            assert x.sampler is not None
            x.start = (x.sampler.epoch, done, x.batches - x.rest)
        return done

    def first_fetch(self) -> int:
        """The loader whose sampler is asked for its first index once every loader's
        iterator is made and before any batch is fetched in this process: the last one if
        it has worker processes (which ask as their iterator is made), else the first one
        without (which asks as the first batch is fetched)."""
        if self.loaders[-1].workers:
            return len(self.loaders) - 1
        return next(i for i, x in enumerate(self.loaders) if not x.workers)
