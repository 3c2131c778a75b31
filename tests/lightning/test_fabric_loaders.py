"""The sampler BucketFabricDDP(elastic=True) puts in loaders from fabric.setup_dataloaders.

Resuming through a real Fabric loop is tested in test_elastic_trainer.py (jobs); here the
order and the epochs it gives, and the errors for a sampler that cannot resume.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from bucketddp import BucketFabricDDP
from bucketddp.elastic import Elastic, ElasticSampler
from bucketddp.elastic.sampler import EpochPosition
from bucketddp.lightning.fabric_loaders import CountingSampler, FabricLoaders

pytest.importorskip("lightning")


def _pair(rank: int) -> tuple[DistributedSampler[int], CountingSampler]:
    theirs: DistributedSampler[int] = DistributedSampler(
        range(30), num_replicas=2, rank=rank, shuffle=True, seed=5
    )
    return theirs, CountingSampler(theirs)


def test_its_order_is_the_distributed_samplers_for_each_count() -> None:
    theirs, ours = _pair(1)
    for count in (0, 1, 4):
        theirs.set_epoch(count)
        ours.set_epoch(count)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_after_a_resume_the_count_goes_on_from_the_resumed_epoch() -> None:
    # A run that used 3 samples per rank of epoch 2, then restarted: Fabric's count is 0.
    position = EpochPosition(epoch=2, base_world=2, offset=3 * 2)
    shards = []
    for rank in (0, 1):
        theirs, ours = _pair(rank)
        ours.resume(position, 3)
        ours.set_epoch(0)  # Fabric's first iteration in the restarted process
        theirs.set_epoch(2)
        assert ours.epoch == 2 and list(ours) == list(theirs)[3:]
        shards += list(ours)
        ours.set_epoch(1)
        theirs.set_epoch(3)
        assert list(ours) == list(theirs)  # the next epoch, whole
    theirs0, theirs1 = _pair(0)[0], _pair(1)[0]
    theirs0.set_epoch(2)
    theirs1.set_epoch(2)
    assert sorted(shards) == sorted(list(theirs0)[3:] + list(theirs1)[3:])


def test_follow_replaces_distributed_and_elastic_samplers_only() -> None:
    loaders = FabricLoaders()

    class Mine(DistributedSampler):  # type: ignore[type-arg]
        pass

    for cls in (DistributedSampler, ElasticSampler, Mine):
        sampler = cls(range(8), num_replicas=2, rank=0)
        loader = loaders.follow(DataLoader(range(8), batch_size=2, sampler=sampler))
        used = loader.batch_sampler.sampler
        if cls is Mine:
            assert used is sampler and loaders.sampler_for(sampler) is sampler
        else:
            assert isinstance(used, CountingSampler) and loaders.sampler_for(sampler) is used
            assert list(used) == list(sampler)


def test_a_sampler_that_cannot_resume_is_named() -> None:
    sampler = DistributedSampler(range(8), num_replicas=2, rank=0)
    with pytest.raises(TypeError, match=r"draws from a DistributedSampler.*setup_dataloaders"):
        BucketFabricDDP(elastic=True).elastic({}, sampler=sampler, batch_size=2)
    # A loader that shows one sampler and draws from another: the error names the second.
    strategy = BucketFabricDDP(elastic=True)
    shown = torch.utils.data.SequentialSampler(range(8))
    loader = DataLoader(range(8), batch_size=2, sampler=shown)
    loader.batch_sampler.sampler = torch.utils.data.RandomSampler(range(8))
    strategy.process_dataloader(loader)
    with pytest.raises(TypeError, match=r"draws from a RandomSampler"):
        strategy.elastic({}, sampler=shown, batch_size=2)
    with pytest.raises(TypeError, match=r"Elastic\(sampler=...\) got a RandomSampler"):
        Elastic({}, sampler=torch.utils.data.RandomSampler(range(8)), batch_size=2)


def test_a_sampler_already_in_a_job_is_refused_at_set_up() -> None:
    # The job would keep the position of a sampler the loader no longer draws from.
    strategy = BucketFabricDDP(elastic=True)
    sampler = ElasticSampler(range(8), num_replicas=2, rank=0)
    with pytest.warns(UserWarning, match="torchrun"):  # no snapshots outside torchrun
        strategy.elastic({}, sampler=sampler, batch_size=2)
    loader = DataLoader(range(8), batch_size=2, sampler=sampler)
    with pytest.raises(RuntimeError, match=r"Set the loader up first, then call"):
        strategy.process_dataloader(loader)
