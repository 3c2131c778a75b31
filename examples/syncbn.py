"""SyncBatchNorm on 2 CPU processes: global batch statistics over gloo, then back to BatchNorm.

torch's ``nn.SyncBatchNorm`` refuses CPU input in training; ``bucketddp.SyncBatchNorm``
works on any backend. Each of the two processes builds a small conv net with BatchNorm,
converts it with ``convert_sync_batchnorm``, wraps it in ``BucketDataParallel`` and trains
it on its own shard. The shards are drawn from different distributions (rank 1's images
are brighter), so per-rank BatchNorm would see different statistics on each rank.

Rank 0 then trains the same net in a single process, with plain BatchNorm, on the
concatenated global batches, and checks that the two runs agree: weights and running
statistics. Finally ``revert_sync_batchnorm`` turns the trained model back into one with
plain ``BatchNorm2d`` layers, for export or single-device inference.

Run it with ``python examples/syncbn.py``; it takes a few seconds.
"""

from __future__ import annotations

import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from bucketddp import BucketDataParallel, convert_sync_batchnorm, revert_sync_batchnorm

WORLD_SIZE = 2
STEPS = 8
BATCH = 8  # per rank
TOLERANCE = 1e-5


def build_model() -> nn.Module:
    """A conv net with two BatchNorm2d layers, always initialized from the same seed."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of the global batch of ``step``; rank r's images are shifted by 2r."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 3, 16, 16, generator=g) + 2.0 * rank
    return x, torch.randint(0, 10, (BATCH,), generator=g)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenation of every rank's shard: what one process would train on."""
    shards = [batch(step, r) for r in range(WORLD_SIZE)]
    return torch.cat([x for x, _ in shards]), torch.cat([y for _, y in shards])


def train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """SGD with momentum, one step per batch, cross-entropy averaged over the batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def run(rank: int, port: int) -> None:
    """One rank: train with SyncBatchNorm; rank 0 checks against single-process training."""
    torch.set_num_threads(1)  # two ranks share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    model = BucketDataParallel(convert_sync_batchnorm(build_model()))
    # Gradients are averaged over ranks, so the local mean loss of equal shards gives the
    # gradient of the mean loss over the global batch.
    train(model, [batch(step, rank) for step in range(STEPS)])

    # The running statistics are global, hence identical on every rank without a broadcast.
    mine = model.module[1].running_mean.clone()
    theirs = [torch.zeros_like(mine) for _ in range(WORLD_SIZE)]
    dist.all_gather(theirs, mine)
    spread = max((t - theirs[0]).abs().max().item() for t in theirs)

    trained = revert_sync_batchnorm(model.module)
    ok = True
    if rank == 0:
        reference = build_model()
        train(reference, [global_batch(step) for step in range(STEPS)])
        diff = max_diff(trained.state_dict(), reference.state_dict())
        trained.eval()
        reference.eval()
        x, _ = global_batch(STEPS)
        with torch.no_grad():
            out_diff = (trained(x) - reference(x)).abs().max().item()
        layers = [type(m).__name__ for m in trained.modules() if "BatchNorm" in type(m).__name__]
        ok = max(diff, out_diff) <= TOLERANCE
        print(
            f"SyncBatchNorm example: {STEPS} steps of SGD on {WORLD_SIZE} CPU processes (gloo), "
            f"batch {BATCH} per rank, rank r's images shifted by 2r\n"
        )
        print(f"running_mean of layer 1, max spread across ranks:           {spread:.1e}")
        print(f"weights and running stats vs BatchNorm on the global batch: {diff:.1e}")
        print(f"eval outputs after revert vs the single-process model:      {out_diff:.1e}")
        print(f"layers after revert_sync_batchnorm: {', '.join(layers)}")
        print(f"agree: {'yes' if ok else 'no'} (tolerance {TOLERANCE:g})")
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    """Start the two ranks; the exit status is 0 when the runs agree."""
    try:
        mp.spawn(run, args=(free_port(),), nprocs=WORLD_SIZE, join=True)
    except mp.ProcessExitedException as e:
        print(f"a rank failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
