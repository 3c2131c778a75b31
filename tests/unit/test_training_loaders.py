"""Several training loaders: each one's place in an epoch (``bucketddp.elastic.loaders``),
and an ``ElasticSampler`` resumed for one pass (``resume(..., once=True)``).

The Trainer fit that resumes them bit-equal is tests/lightning/test_elastic_loaders.py.
"""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from bucketddp.elastic.loaders import TrainingLoader, TrainingLoaders, batches_in
from bucketddp.elastic.sampler import ElasticSampler, EpochPosition


@pytest.mark.parametrize(
    ("processed", "batches", "mode", "expected"),
    [
        (0, 8, "max_size_cycle", 0),
        (5, 8, "max_size_cycle", 5),
        (8, 8, "max_size_cycle", 8),  # ran out, not started over yet: a whole pass used
        (9, 8, "max_size_cycle", 1),
        (16, 8, "max_size_cycle", 8),
        (9, 8, "max_size", 8),  # ran out: yields nothing more
        (5, 8, "min_size", 5),
    ],
)
def test_batches_into_the_current_pass(
    processed: int, batches: int, mode: str, expected: int
) -> None:
    assert batches_in(processed, batches, mode) == expected


def _pass_of(world: int, epoch: int, seed: int) -> list[int]:
    reference = DistributedSampler(range(32), num_replicas=world, rank=0, seed=seed)
    reference.set_epoch(epoch)
    return list(reference)


def test_a_pass_resumed_once_is_followed_by_whole_passes_in_its_epoch() -> None:
    sampler = ElasticSampler(range(32), num_replicas=2, rank=0, seed=4)
    sampler.set_epoch(1)
    whole = list(sampler)
    sampler.resume(EpochPosition(epoch=1, base_world=2, offset=6), 3, once=True)
    assert list(sampler) == whole[3:]  # the rest of the pass it stopped in
    assert list(sampler) == whole == _pass_of(2, 1, 4)  # the next pass: whole
    # At an unchanged world size, a position counts from its pass's start either way.
    assert sampler.position(5) == EpochPosition(epoch=1, base_world=2, offset=10)


def test_an_iterator_never_asked_for_an_index_leaves_the_resume_in_place() -> None:
    sampler = ElasticSampler(range(32), num_replicas=2, rank=0, seed=4)
    sampler.resume(EpochPosition(epoch=0, base_world=2, offset=4), 2, once=True)
    iter(sampler)  # made and dropped, as a StatefulDataLoader may
    assert list(sampler) == list(DistributedSampler(range(32), num_replicas=2, rank=0, seed=4))[2:]


def _loaders(workers: list[bool]) -> TrainingLoaders:
    loaders = TrainingLoaders()
    for w in workers:
        sampler = ElasticSampler(range(32), num_replicas=2, rank=0)
        loaders.add(TrainingLoader(sampler, batch_size=4, batches=4, workers=w))
    loaders.started(len(workers), "max_size_cycle")
    return loaders


def test_positions_of_a_cycling_loader_and_of_the_longest() -> None:
    loaders = _loaders([False, False])
    loaders.loaders[1].batches = 16  # the epoch's longest
    loaders.loaders[1].batch_size = 1
    first, second = loaders.positions(6)
    assert first["used"] == 8  # 2 batches into its second pass
    assert first["position"] == EpochPosition(epoch=0, base_world=2, offset=16)
    assert second["used"] == 6
    assert second["position"] == EpochPosition(epoch=0, base_world=2, offset=12)


@pytest.mark.parametrize(
    ("workers", "first"),
    [([False, False], 0), ([True, True], 1), ([True, False], 1), ([False, True], 1)],
)
def test_the_generators_go_back_where_the_first_index_is_asked_for(
    workers: list[bool], first: int
) -> None:
    # Workers ask as their iterator is made (the last one made is the last loader); a loader
    # without asks at the first fetch, after every iterator is made.
    assert _loaders(workers).first_fetch() == first


def test_a_set_of_loaders_starts_anew_when_lightning_sets_them_up_again() -> None:
    loaders = _loaders([False, False])
    sampler = ElasticSampler(range(32), num_replicas=2, rank=0)
    assert loaders.add(TrainingLoader(sampler, 4, 4, False)) == 0
    assert loaders.several and len(loaders.loaders) == 1
    assert not loaders.followed()  # one of two so far
    assert loaders.add(TrainingLoader(None, 4, 4, False)) == 1
    assert not loaders.followed()  # a sampler that is not an ElasticSampler
    loaders.loaders[1].sampler = sampler
    assert loaders.followed()
    loaders.started(2, "sequential")
    assert not loaders.followed()
