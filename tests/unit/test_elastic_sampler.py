"""ElasticSampler: DistributedSampler's order, and no sample lost or repeated on resume."""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from bucketddp.elastic.sampler import ElasticSampler, EpochPosition


def _samplers(cls: type, size: int, world: int, **kw: object) -> list[DistributedSampler]:
    return [cls(range(size), num_replicas=world, rank=r, **kw) for r in range(world)]


@pytest.mark.parametrize("size", [24, 25, 3])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_same_order_as_distributed_sampler(size: int, drop_last: bool, shuffle: bool) -> None:
    kw = {"drop_last": drop_last, "shuffle": shuffle, "seed": 7}
    for ours, theirs in zip(
        _samplers(ElasticSampler, size, 4, **kw),
        _samplers(DistributedSampler, size, 4, **kw),
        strict=True,
    ):
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def _used(samplers: list[ElasticSampler], k: int) -> list[int]:
    return [i for s in samplers for i in list(s)[:k]]


@pytest.mark.parametrize(("world", "new_world"), [(2, 2), (2, 1), (2, 3), (4, 2)])
def test_resume_takes_every_remaining_sample_once(world: int, new_world: int) -> None:
    size, used = 48, 6  # what is left divides evenly for every world size here: no padding
    before = _samplers(ElasticSampler, size, world, seed=3)
    for s in before:
        s.set_epoch(1)
    positions = {s.position(used) for s in before}
    assert len(positions) == 1  # every rank agrees where the epoch stands
    (position,) = positions
    assert position == EpochPosition(epoch=1, base_world=world, offset=used * world)
    after = _samplers(ElasticSampler, size, new_world, seed=3)
    for s in after:
        s.resume(position, used)
    seen = _used(before, used) + [i for s in after for i in s]
    assert sorted(seen) == list(range(size))
    if new_world == world:  # the same world size: exactly the rest of each rank's order
        reference = _samplers(DistributedSampler, size, world, seed=3)
        for r, s in enumerate(after):
            reference[r].set_epoch(1)
            assert list(s) == list(reference[r])[used:]
    # len() is a whole epoch's share at the new size; the resumed epoch yields what is left
    assert {len(s) for s in after} == {size // new_world}
    assert {len(list(s)) for s in after} == {(size - used * world) // new_world}


def test_a_second_resume_in_the_same_epoch_continues_from_the_first() -> None:
    size = 60
    first = _samplers(ElasticSampler, size, 3, seed=0)
    position = first[0].position(4)
    second = _samplers(ElasticSampler, size, 2, seed=0)
    for s in second:
        s.resume(position, 4)
    position2 = second[0].position(4 + 6)  # six more samples per rank at world size 2
    third = _samplers(ElasticSampler, size, 4, seed=0)
    for s in third:
        s.resume(position2, 10)
    seen = (
        _used(first, 4) + [i for s in second for i in list(s)[:6]] + [i for s in third for i in s]
    )
    assert sorted(seen) == list(range(size))


def test_the_next_epoch_is_plain_distributed_sampler_order() -> None:
    s = ElasticSampler(range(20), num_replicas=2, rank=1, seed=5)
    s.resume(EpochPosition(epoch=0, base_world=4, offset=8), 2)
    s.set_epoch(1)
    reference = DistributedSampler(range(20), num_replicas=2, rank=1, seed=5)
    reference.set_epoch(1)
    assert list(s) == list(reference) and len(s) == len(reference)


def test_before_first_runs_as_the_first_index_is_asked_for() -> None:
    calls: list[str] = []
    sampler = ElasticSampler(range(8), num_replicas=2, rank=0, shuffle=False)
    sampler.before_first = lambda: calls.append("first")
    indices = iter(sampler)
    assert calls == []  # not at iter(): a loader may make an iterator it never uses
    assert next(indices) == 0 and calls == ["first"]
    assert list(indices) == [2, 4, 6] and list(sampler) == [0, 2, 4, 6] and calls == ["first"]
    # An epoch with nothing left (resumed at its end) still calls it, as it ends.
    sampler.resume(EpochPosition(epoch=0, base_world=2, offset=8), 4)
    sampler.before_first = lambda: calls.append("empty")
    assert list(sampler) == [] and calls == ["first", "empty"]
