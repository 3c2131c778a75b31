"""``ReplaySampler``: any sampler, resumable mid-epoch at the same world size by replaying.

``ElasticSampler`` knows ``DistributedSampler``'s order, so it can start an epoch anywhere
and split what is left over another number of ranks. Another sampler (a subclass, a
weighted one in Lightning's ``DistributedSamplerWrapper``, one of your own) has an order
only it can make: this wrapper makes it again and drops what was used.

Its order may depend on the epoch (``set_epoch``, called on the sampler itself) and on the
global random generators, which a sampler such as ``RandomSampler`` without a
``generator`` draws from when an epoch's iteration starts. So the wrapper notes the
generators' state as each epoch's order is drawn (``started``). To resume, it sets that
state, has the sampler draw the same order, skips the indices the ranks used, and then
calls ``then`` (the resume's own generators go back there: the next draws are the
batches' own). This is what torchdata's ``StatefulDataLoader`` does for a sampler without
a ``state_dict``, fast-forwarding by the batches yielded, plus the generators.

It is exact at the same world size only: at another one the sampler's order is another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from itertools import islice
from typing import Any

from torch.utils.data import Sampler

from . import rng


class ReplaySampler(Sampler[Any]):
    """``sampler``, whose next iteration can resume its epoch after ``skip`` indices."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.started: dict[str, Any] | None = None
        """The generators' state as this epoch's order was drawn."""
        self._resume: tuple[int, dict[str, Any] | None, Callable[[], None]] | None = None
        self._ended: int | None = None  # an epoch resumed at its end: nothing left in it

    def __len__(self) -> int:
        if not isinstance(self.sampler, Sized):
            raise TypeError(f"{type(self.sampler).__name__} has no len()")
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:
        # Only for what this class lacks: the sampler's own attributes (``epoch``, ...).
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def resume(
        self,
        skip: int,
        started: dict[str, Any] | None,
        then: Callable[[], None],
        epoch: int | None = None,
        ended: int | None = None,
    ) -> None:
        """Have the next iteration draw its order from the generators' state ``started``
        (None: as they are), skip ``skip`` indices, and call ``then`` as the first is
        asked for.

        ``epoch``: the epoch resumed, set on a sampler that takes ``set_epoch`` now, so
        that an iterator made before the loop sets it (a loader with worker processes asks
        for its first indices as it is made) draws that epoch's order.

        ``ended``: the epoch before it, which the snapshot ended: on a sampler that keeps
        its ``epoch``, an iteration while it is set to that one yields nothing (Lightning
        before 2.5 finishes such an epoch again, and takes whatever its iterator yields as
        the epoch's rest).
        """
        self._resume = (skip, started, then)
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if epoch is not None and callable(set_epoch):
            set_epoch(epoch)
        keeps_epoch = callable(set_epoch) and hasattr(self.sampler, "epoch")
        self._ended = ended if keeps_epoch else None

    def __iter__(self) -> Iterator[Any]:
        # All at the first index asked for, not at ``iter()``: a loader may make an
        # iterator it never uses (torchdata's StatefulDataLoader makes its sampler's at
        # once, and Lightning makes one before the epoch's), and may draw its own seed
        # between making one and asking it (torch's DataLoader).
        if self._ended is not None and getattr(self.sampler, "epoch", None) == self._ended:
            return
        resume, self._resume = self._resume, None
        if resume is None:
            self.started = rng.capture()
            yield from self.sampler
            return
        skip, started, then = resume
        if started is not None:
            rng.restore(started)
        self.started = rng.capture()
        indices = iter(self.sampler)
        for _ in islice(indices, skip):
            pass
        then()
        yield from indices
