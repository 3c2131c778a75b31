"""The main job: the same training on 2 CPU processes with bucketddp and with torch DDP.

Each of the two processes builds the same MLP twice from one seed, wraps one copy in
``bucketddp.BucketDataParallel`` and the other in ``torch.nn.parallel.DistributedDataParallel``,
and trains both on the same batches (each rank its own shard) with SGD and momentum. The
two are stepped alternately, so a busy machine slows both alike. At the end rank 0 prints
the median time per step of each and whether the final weights agree.

Run it with ``make demo`` or ``python examples/demo.py``; it takes well under a minute.
"""

from __future__ import annotations

import itertools
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bucketddp import BucketDataParallel

WORLD_SIZE = 2
STEPS = 30
WARMUP = 5  # the first steps build buckets and warm caches; they are not timed
BATCH = 32  # per rank
WIDTHS = (1024, 2048, 2048, 10)
TOLERANCE = 1e-6


def build_model() -> nn.Module:
    """An MLP of about 6.3M parameters, always initialized from the same seed."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of the global batch of ``step``: the same for both systems."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, WIDTHS[0], generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int) -> float:
    """One forward, backward and optimizer step; returns the loss."""
    x, y = batch(step, rank)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def run(rank: int, port: int) -> None:
    """One rank: train both systems side by side; rank 0 prints the comparison."""
    torch.set_num_threads(1)  # two ranks share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    systems = {
        "bucketddp": BucketDataParallel(build_model()),
        "torch DDP": DistributedDataParallel(build_model()),
    }
    optimizers = {
        name: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for name, m in systems.items()
    }
    times: dict[str, list[float]] = {name: [] for name in systems}
    losses: dict[str, float] = {}
    for step in range(STEPS):
        order = list(systems) if step % 2 == 0 else list(reversed(systems))
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            losses[name] = train_step(systems[name], optimizers[name], step, rank)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            if step >= WARMUP:
                times[name].append(elapsed.item())

    ours, theirs = systems["bucketddp"].module, systems["torch DDP"].module
    diff = torch.tensor(
        max(
            (a - b).abs().max().item()
            for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
        )
    )
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if rank == 0:
        params = sum(p.numel() for p in ours.parameters())
        print(
            f"bucketddp demo: an MLP with {params / 1e6:.1f}M parameters, {STEPS} steps of SGD "
            f"with momentum on {WORLD_SIZE} CPU processes (gloo), batch {BATCH} per rank\n"
        )
        print(f"{'':28}{'bucketddp':>12}{'torch DDP':>12}")
        medians = {name: 1000 * statistics.median(ts) for name, ts in times.items()}
        print(
            f"{'median time per step (ms)':28}{medians['bucketddp']:12.1f}"
            f"{medians['torch DDP']:12.1f}"
        )
        print(f"{'final loss':28}{losses['bucketddp']:12.4f}{losses['torch DDP']:12.4f}")
        stats = systems["bucketddp"].comm_stats
        print(
            f"\nbucketddp: {stats.buckets} buckets, {stats.bytes_reduced / 2**20:.1f} MB reduced "
            f"per step, {1000 * stats.wait_seconds:.1f} ms waiting at the end of backward"
        )
        ratio = medians["bucketddp"] / medians["torch DDP"]
        print(f"time per step, bucketddp / torch DDP: {ratio:.2f}")
        agree = diff.item() <= TOLERANCE
        print(f"final weights, max |bucketddp - torch DDP|: {diff.item():.2e}")
        print(f"weights agree: {'yes' if agree else 'no'} (tolerance {TOLERANCE:g})")
    dist.destroy_process_group()
    if diff.item() > TOLERANCE:
        sys.exit(1)


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    """Start the two ranks; the exit status is 0 when the weights agree."""
    try:
        mp.spawn(run, args=(free_port(),), nprocs=WORLD_SIZE, join=True)
    except mp.ProcessExitedException as e:
        return e.exit_code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
