"""Elastic training under torchrun: a failed rank costs one step, not the run.

At every step boundary (or every ``n``) each rank copies its share of the full training
state into node-local shared memory; after torchrun restarts the workers, at the same world
size or another, the ranks find the newest complete snapshot on any node, agree on it, and
its holder sends it to every rank (``docs/elastic.md``).

- ``Elastic``: snapshots and resume for a hand-written loop (``BucketDataParallel``, Fabric);
  ``BucketDDP(elastic=True)`` does it all for the Trainer.
- ``ElasticSampler``: ``DistributedSampler``'s order, resumable mid-epoch at any world size.
- ``init_process_group``: a process group that forms reliably after a torchrun restart.

Nothing here imports Lightning.
"""

from .group import init_process_group
from .loop import Elastic
from .sampler import ElasticSampler, EpochPosition

__all__ = ["Elastic", "ElasticSampler", "EpochPosition", "init_process_group"]
