"""Loaders set up by ``fabric.setup_dataloaders`` under ``BucketFabricDDP(elastic=True)``.

Fabric's loader sets its sampler's epoch to the number of times this process has iterated
it. After torchrun restarts the workers that count starts at 0 again, so a resumed run
would draw every later epoch's order from the wrong epoch: other rows than the run that
was interrupted, and the resumed epoch whole again. So the strategy puts a
``CountingSampler`` in each such loader in place of its ``DistributedSampler`` (the one
Fabric made, or an ``ElasticSampler`` of yours): an ``ElasticSampler`` with the same order,
whose epoch is Fabric's count plus the epoch a resume started in.
``strategy.elastic(state, sampler=loader.sampler)`` finds it from the sampler the loader
was made with. Other samplers (Fabric's wrapper around a weighted one, your own
``DistributedSampler`` subclass) are left as they are.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch.utils.data import DistributedSampler

from ..elastic.loop import in_a_job
from ..elastic.sampler import ElasticSampler, EpochPosition, same_order


class CountingSampler(ElasticSampler):
    """An ``ElasticSampler`` with ``like``'s order, whose ``set_epoch(n)`` (Fabric's n-th
    iteration of the loader in this process) sets the epoch ``n`` plus the resumed one."""

    def __init__(self, like: DistributedSampler[Any]) -> None:
        super().__init__(like.dataset, **same_order(like))
        self._offset = 0
        self.epoch = like.epoch

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch to ``epoch`` iterations after the one a resume started in."""
        super().set_epoch(epoch + self._offset)

    def resume(self, position: EpochPosition, used: int, *, once: bool = False) -> None:
        """Continue ``position``'s epoch; this process's first iteration is that epoch."""
        self._offset = 0
        super().resume(position, used, once=once)
        self._offset = position.epoch


class FabricLoaders:
    """The sampler each loader set up so far draws from, by the samplers it shows
    (``loader.sampler``, and its batch sampler's before the set-up)."""

    def __init__(self) -> None:
        self._drawn: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def follow(self, dataloader: Any) -> Any:
        """Put a ``CountingSampler`` in ``dataloader`` in place of a ``DistributedSampler``
        or ``ElasticSampler`` (a subclass of yours is left as it is)."""
        batch_sampler: Any = getattr(dataloader, "batch_sampler", None)
        drawn: Any = getattr(batch_sampler, "sampler", None)
        if drawn is None:
            return dataloader
        shown = [drawn, getattr(dataloader, "sampler", None)]
        if in_a_job(drawn):
            raise RuntimeError(
                "fabric.setup_dataloaders: the loader's ElasticSampler is already in "
                "strategy.elastic(...)'s job, which would keep the position of a sampler the "
                "set-up loader no longer draws from. Set the loader up first, then call "
                "strategy.elastic(state, sampler=loader.sampler, ...)"
            )
        if type(drawn) in (DistributedSampler, ElasticSampler):
            drawn = batch_sampler.sampler = CountingSampler(drawn)
        for sampler in shown:
            if sampler is not None:
                self._drawn[sampler] = drawn
        return dataloader

    def sampler_for(self, sampler: Any) -> Any:
        """The sampler that a loader set up draws from in place of ``sampler`` (itself if
        no loader showed it)."""
        if sampler is None:
            return None
        return self._drawn.get(sampler, sampler)
