"""The first epoch of a resumed fit, started where the uninterrupted fit would start it.

Lightning 2.6's ``FitLoop.run`` makes the training loader's iterator in ``setup_data``
(after loading a StatefulDataLoader's saved position into it) and only then, in
``on_advance_start``, calls ``set_epoch`` on the samplers; since Lightning 2.5.3 the epoch
loop keeps that iterator for the first epoch of a resumed fit. Two things go wrong:

- The ``DistributedSampler`` Lightning injects is new, so at epoch 0. An iterator that draws
  its indices as it is made (a StatefulDataLoader restoring its position, or any loader
  with worker processes) trains the resumed epoch on epoch 0's order.
- A StatefulDataLoader saved on an epoch's last batch is restored at that epoch's end,
  though the loop has moved on to the next epoch: that epoch ends at once, without a batch.

``BucketDDP`` calls ``realign_sampler_epoch`` from ``on_train_start``, which Lightning calls
after the loop has restored its progress and before it fetches the first batch. There the
samplers get the epoch the loop is about to run, and the loader's iterator is made again:
from the saved position if the loaders were saved in that epoch, else from the epoch's
start. Nothing else changes: the random generators a new iterator draws its seed from are
put back as they were.

No Lightning import here; the Lightning names this module reads, and the private ones among
them, are listed in ``trainer.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SavedLoaders", "realign_sampler_epoch"]

_LOADER_STATES = ("loops", "fit_loop", "state_dict", "combined_loader")
"""Where a Lightning checkpoint keeps the stateful training loaders' states."""


@dataclass(frozen=True)
class SavedLoaders:
    """What a Lightning checkpoint holds of the training loaders.

    Attributes:
        epoch: the epoch the checkpoint was saved in (its ``"epoch"``, the trainer's
            ``current_epoch``), or None if it has none.
        states: a copy of the stateful loaders' states, in their order ([] if none): a copy,
            so that they can be loaded once more after Lightning has loaded the originals.
    """

    epoch: int | None = None
    states: list[Any] = field(default_factory=list)

    @classmethod
    def from_checkpoint(cls, checkpoint: Mapping[str, Any]) -> SavedLoaders:
        """The training loaders' part of a loaded Lightning checkpoint."""
        node: Any = checkpoint
        for key in _LOADER_STATES:
            node = node.get(key) if isinstance(node, Mapping) else None
        epoch = checkpoint.get("epoch")
        return cls(epoch if isinstance(epoch, int) else None, copy.deepcopy(list(node or [])))


def realign_sampler_epoch(fit_loop: Any, saved: SavedLoaders, combined: Any, fetcher: Any) -> bool:
    """Start the epoch a resumed ``fit_loop`` is about to run from the right place: its
    training samplers at that epoch, and its stateful loaders at their saved position if it
    is the epoch they were saved in, else at its start.

    ``fit_loop`` is ``trainer.fit_loop`` at ``on_train_start``, where the loader's iterator
    is made but no batch drawn. If the samplers' epoch or the loaders' position is not the
    right one, the samplers get the epoch and the iterator is made again, as
    ``FitLoop.setup_data`` made it. ``combined`` and ``fetcher`` are the loop's training
    loaders and the fetcher that made their iterator (``internals.loader_and_fetcher``).
    Returns whether it was made again.
    """
    if not _resuming(fit_loop) or combined is None or fetcher is None:
        return False
    epoch = fit_loop.epoch_progress.current.processed  # what on_advance_start will set
    samplers = [s for loader in combined.flattened for s in _epoch_samplers(loader)]
    # Lightning loads the saved states into a restarting loop (FitLoop.setup_data); states
    # saved in an earlier epoch (on its last batch) would make the next one empty.
    loaded = fit_loop.restarting and bool(saved.states)
    stale = loaded and saved.epoch is not None and saved.epoch != epoch
    if not stale and all(getattr(s, "epoch", None) == epoch for s in samplers):
        return False
    for sampler in samplers:
        sampler.set_epoch(epoch)
    with _generators_kept(combined.flattened):
        combined.reset()  # ends the stale iterators' worker processes
        if loaded and not stale:
            stateful = [loader for loader in combined.flattened if _is_stateful(loader)]
            for loader, state in zip(stateful, saved.states, strict=True):
                loader.load_state_dict(state)
        iter(fetcher)
    return True


def _resuming(fit_loop: Any) -> bool:
    # ``is_resuming`` came with Lightning 2.5.3, which keeps setup_data's iterator on resume;
    # before it, ``restarting`` (set by the same checkpoint load) is the nearest (untested).
    resuming = getattr(fit_loop, "is_resuming", None)
    return bool(fit_loop.restarting if resuming is None else resuming)


def _epoch_samplers(loader: object) -> list[Any]:
    """The samplers of ``loader`` that take ``set_epoch``, where Lightning looks for them."""
    found: dict[int, Any] = {}
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)):
            found[id(sampler)] = sampler
    return list(found.values())


def _is_stateful(loader: object) -> bool:
    return all(callable(getattr(loader, name, None)) for name in ("state_dict", "load_state_dict"))


@contextmanager
def _generators_kept(loaders: list[Any]) -> Iterator[None]:
    """Put back the generators a new loader iterator draws its seed from."""
    generators = {id(torch.default_generator): torch.default_generator}
    for loader in loaders:
        if isinstance(generator := getattr(loader, "generator", None), torch.Generator):
            generators[id(generator)] = generator
    states = [(g, g.get_state()) for g in generators.values()]
    try:
        yield
    finally:
        for generator, state in states:
            generator.set_state(state)
