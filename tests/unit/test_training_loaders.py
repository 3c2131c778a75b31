"""Several training loaders: each one's place in an epoch (``bucketddp.elastic.loaders``),
and an ``ElasticSampler`` resumed for one pass (``resume(..., once=True)``).

The Trainer fit that resumes them bit-equal is tests/lightning/test_elastic_loaders.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
from torch.utils.data import BatchSampler, DistributedSampler

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


@pytest.mark.parametrize(
    ("processed", "mode", "expected"),
    [
        (4, "max_size_cycle", 2),  # resumed there, 2 batches into a pass of 8
        (5, "max_size_cycle", 3),
        (10, "max_size_cycle", 8),  # the resumed pass ran out
        (11, "max_size_cycle", 1),  # the next one, whole
        (11, "max_size", 8),
    ],
)
def test_batches_into_a_pass_resumed_at_another_world_size(
    processed: int, mode: str, expected: int
) -> None:
    # Resumed with 4 batches of the epoch counted as done, 2 batches into its pass.
    assert batches_in(processed, 8, mode, start=(4, 2)) == expected


# a: 8 batches a pass on 2 ranks; b: 11, the epoch's length. Row counts that world sizes
# do not divide: positions then depend on the world size the order was dealt to.
SIZES = ((62, 4), (61, 3))


def _ranks(world: int, mode: str) -> list[TrainingLoaders]:
    """Each rank's two training loaders (rows, batch size) of ``SIZES``, as registered."""
    ranks = []
    for rank in range(world):
        loaders = TrainingLoaders()
        for rows, size in SIZES:
            sampler = ElasticSampler(range(rows), num_replicas=world, rank=rank, seed=3)
            batches = len(BatchSampler(sampler, size, drop_last=False))
            loaders.add(TrainingLoader(sampler, size, batches, workers=False))
        loaders.started(len(SIZES), mode)
        ranks.append(loaders)
    return ranks


Passes = list[list[Counter[int]]]  # per loader, the rows each of its passes used


def _train(ranks: list[TrainingLoaders], done: int, stop: int, passes: Passes) -> int:
    """Train every rank from ``done`` batches of the epoch until ``stop`` or the epoch's
    end, as Lightning combines the loaders and counts the epoch's batches; returns where
    the ranks stopped. A pass begun within the run is a new entry of ``passes``."""
    ends, first = set(), [len(p) - 1 for p in passes]
    for loaders in ranks:
        mode = loaders.mode
        its = [iter(BatchSampler(x.sampler, x.batch_size, False)) for x in loaders.loaders]
        number = list(first)
        k = done
        while k < min(stop, loaders.epoch_batches()):
            for i, x in enumerate(loaders.loaders):
                rows = next(its[i], None)
                if rows is None and mode == "max_size_cycle":  # starts over
                    number[i] += 1
                    if number[i] == len(passes[i]):
                        passes[i].append(Counter())
                    its[i] = iter(BatchSampler(x.sampler, x.batch_size, False))
                    rows = next(its[i])
                if rows is None and mode == "min_size":
                    break
                passes[i][number[i]].update(rows or [])
            else:
                k += 1
                continue
            break
        ends.add(k)
    assert len(ends) == 1, ends  # every rank trained as many batches
    return ends.pop()


def _resume(
    world: int, mode: str, entries: list[dict[str, object]], resized: bool
) -> list[TrainingLoaders]:
    ranks = _ranks(world, mode)
    for loaders in ranks:
        for index, entry in enumerate(entries):
            loaders.resume(index, entry, resized, ended=False)
    return ranks


# Stopped after so many batches of the epoch, then resumed on each world size in turn,
# stopped again 2 batches later until the last, which finishes the epoch.
CASES = [(5, [1]), (9, [1]), (5, [4]), (9, [3]), (3, [1, 2]), (3, [3, 3, 1]), (5, [3, 1])]


@pytest.mark.parametrize(
    ("mode", "stop", "worlds"),
    [(mode, *case) for mode in ("max_size_cycle", "max_size") for case in CASES]
    + [("min_size", *case) for case in CASES if case[0] < 6],  # its epochs have 8 batches
)
def test_an_epoch_resumed_at_another_world_size_uses_each_pass_once(
    mode: str, stop: int, worlds: list[int]
) -> None:
    # The ground truth: the epoch run through at world size 2 uses each loader's rows once
    # per pass; one stopped and resumed on other world sizes must too (up to
    # DistributedSampler's padding of a short rest), and end where the loader that ends the
    # epoch runs out. A resume at an unchanged size keeps where each pass began.
    whole: Passes = [[Counter()], [Counter()]]
    _train(_ranks(2, mode), 0, 99, whole)
    passes: Passes = [[Counter()], [Counter()]]
    ranks, world = _ranks(2, mode), 2
    assert _train(ranks, 0, stop, passes) == stop
    for number, new_world in enumerate(worlds):
        entries = ranks[0].positions(stop)
        ranks = _resume(new_world, mode, entries, resized=new_world != world)
        done = ranks[0].epoch_rest() if new_world != world else stop
        world, last = new_world, number == len(worlds) - 1
        stop = _train(ranks, done, 99 if last else done + 2, passes)
    for i, (rows, _) in enumerate(SIZES):
        for number, used in enumerate(passes[i]):
            whole_pass = number < len(whole[i]) and set(whole[i][number]) == set(range(rows))
            if whole_pass:  # a pass the uninterrupted epoch finished: every row, pads aside
                assert set(used) == set(range(rows)), (i, number)
                assert used.total() - rows < 5, (i, number)  # each rest padded once at most
            assert max(used.values()) <= 2, (i, number)
    # The loader that ends the epoch (the shortest in min_size, else b) ran its pass once.
    ender = 0 if mode == "min_size" else 1
    assert set(passes[ender][0]) == set(range(SIZES[ender][0]))
    assert len(passes[1]) == 1
