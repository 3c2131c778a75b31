"""ReplaySampler: an epoch of any sampler, resumed by drawing its order again and skipping.

Single-process: the sampler alone, against the order the same sampler gave uninterrupted
(the distributed resume is tested under torchrun in tests/lightning/test_elastic_trainer.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch.utils.data import RandomSampler, Sampler

from bucketddp.elastic.replay import ReplaySampler


class _Eager(Sampler[int]):
    """Draws its whole order from the global generator when ``iter()`` is called."""

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(12).tolist())

    def __len__(self) -> int:
        return 12


def _first_epoch(sampler: Sampler[int]) -> tuple[list[int], dict]:
    torch.manual_seed(0)
    wrapped = ReplaySampler(sampler)
    order = list(wrapped)
    assert wrapped.started is not None
    return order, wrapped.started


def test_a_resumed_epoch_draws_the_same_order_and_skips_what_was_used() -> None:
    for sampler in (RandomSampler(range(12)), _Eager()):
        order, started = _first_epoch(sampler)
        torch.manual_seed(99)  # the restarted process's generators are elsewhere
        events: list[str] = []
        resumed = ReplaySampler(sampler)
        resumed.resume(5, started, functools.partial(events.append, "then"))
        rest = []
        for index in resumed:
            events.append("index")
            rest.append(index)
        assert rest == order[5:], type(sampler).__name__
        assert events[:2] == ["then", "index"] and events.count("then") == 1


def test_then_sets_the_generators_after_the_order_is_drawn() -> None:
    order, started = _first_epoch(RandomSampler(range(12)))
    torch.manual_seed(7)
    after = torch.get_rng_state()
    resumed = ReplaySampler(RandomSampler(range(12)))
    resumed.resume(3, started, lambda: torch.set_rng_state(after))
    assert next(iter(resumed)) == order[3]
    assert torch.equal(torch.get_rng_state(), after)


def test_an_iterator_never_asked_leaves_the_resume_to_the_next() -> None:
    order, started = _first_epoch(_Eager())
    resumed = ReplaySampler(_Eager())
    resumed.resume(4, started, lambda: None)
    unused = iter(resumed)  # as a StatefulDataLoader, or Lightning, may make and drop one
    del unused
    assert list(resumed) == order[4:]
    assert sorted(resumed) == list(range(12))  # the next epoch: whole again


def test_it_passes_the_samplers_length_and_attributes_through() -> None:
    inner = RandomSampler(range(12))
    wrapped = ReplaySampler(inner)
    assert len(wrapped) == 12
    assert wrapped.data_source is inner.data_source


def test_resume_sets_the_resumed_epoch_on_a_sampler_that_takes_one() -> None:
    # A loader with worker processes asks for indices as its iterator is made, before
    # Lightning sets the epoch: the order must be the resumed epoch's already.
    inner = torch.utils.data.DistributedSampler(range(12), num_replicas=1, rank=0, seed=3)
    inner.set_epoch(2)
    order = list(inner)
    inner.set_epoch(0)
    resumed = ReplaySampler(inner)
    resumed.resume(5, None, lambda: None, epoch=2)
    assert resumed.epoch == 2
    assert list(resumed) == order[5:]
    plain = ReplaySampler(_Eager())  # no set_epoch: nothing to set
    plain.resume(1, None, lambda: None, epoch=2)
    assert len(list(plain)) == 11


def test_an_epoch_resumed_at_its_end_yields_nothing_while_it_is_set() -> None:
    # Lightning 2.4 finishes the snapshot's epoch again, setting it on the sampler, with an
    # iterator of its own: that epoch has nothing left; the next one is whole.
    inner = torch.utils.data.DistributedSampler(range(12), num_replicas=1, rank=0, seed=3)
    inner.set_epoch(2)
    order = list(inner)
    resumed = ReplaySampler(inner)
    resumed.resume(0, None, lambda: None, epoch=2, ended=1)
    resumed.set_epoch(1)
    assert list(resumed) == []
    resumed.set_epoch(2)
    assert list(resumed) == order
    plain = ReplaySampler(_Eager())  # no epoch to tell by: the next iteration is whole
    plain.resume(0, None, lambda: None, epoch=2, ended=1)
    assert len(list(plain)) == 12
