"""The main job: learn handwritten digits on 2 CPU processes, with bucketddp and torch DDP.

The data are scikit-learn's handwritten digits: 1,797 images of 8x8 pixels that ship inside
the scikit-learn package, so nothing is downloaded. 297 of them are held out; the model
trains on the other 1,500.

Each of the two processes builds the same MLP twice from one seed, wraps one copy in
``bucketddp.BucketDataParallel`` and the other in ``torch.nn.parallel.DistributedDataParallel``,
and trains both on the same batches (each rank its half of every global batch) with SGD and
momentum. The two are stepped alternately, so a busy machine slows both alike. At the end
rank 0 prints each one's held-out accuracy and median time per step, and the largest
difference between their final weights.

Run it with ``python3 dev.py demo`` or ``python examples/demo.py``; it takes seconds.
``train`` is the part that runs on each rank: the test suite and
``benchmarks/bench_convergence.py`` reuse it and its pieces.
"""

from __future__ import annotations

import socket
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bucketddp import BucketDataParallel

WORLD_SIZE = 2
EPOCHS = 10
BATCH = 32  # per rank: a global batch of 64 images
HIDDEN = 512
HELD_OUT = 297  # images kept out of training, to measure accuracy on
LR = 0.1
MOMENTUM = 0.9
WARMUP = 5  # the first steps build buckets and warm caches; they are not timed
TOLERANCE = 1e-6
TARGET_ACCURACY = 0.9


@dataclass(frozen=True)
class Digits:
    """The digits, pixels scaled to [0, 1], split once into training and held-out images."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    def steps_per_epoch(self, world_size: int) -> int:
        """Full global batches in one pass over the training images."""
        return len(self.train_y) // (BATCH * world_size)


def load_digits_split() -> Digits:
    """scikit-learn's digits, shuffled with a fixed seed and split: the same on every rank."""
    from sklearn.datasets import load_digits

    pixels, labels = load_digits(return_X_y=True)
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0  # pixel values are 0..16
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:HELD_OUT], order[HELD_OUT:]
    return Digits(x[train], y[train], x[test], y[test])


def build_model(seed: int = 0) -> nn.Module:
    """An MLP of 300k parameters (64 pixels -> 512 -> 512 -> 10 classes), seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 10),
    )


def shard(
    data: Digits, step: int, rank: int, world_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's half of global batch ``step``: each epoch is a fresh shuffle of the
    training images, the same on every rank and for every system."""
    per_epoch = data.steps_per_epoch(world_size)
    epoch, index = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(1000 * seed + epoch)
    order = torch.randperm(len(data.train_y), generator=g)
    start = (index * world_size + rank) * BATCH
    mine = order[start : start + BATCH]
    return data.train_x[mine], data.train_y[mine]


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    """One forward, backward and optimizer step; returns the loss."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def timed_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, float]:
    """``train_step``, timed; returns the loss and the seconds of the slowest rank."""
    dist.barrier()  # every rank starts the step together
    start = time.perf_counter()
    loss = train_step(model, optimizer, x, y)
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return loss, elapsed.item()


@torch.no_grad()
def accuracy(model: nn.Module, data: Digits, rank: int, world_size: int) -> float:
    """The fraction of held-out images classified right; each rank scores its share."""
    x, y = data.test_x[rank::world_size], data.test_y[rank::world_size]
    counts = torch.tensor([(model(x).argmax(dim=1) == y).sum().item(), len(y)])
    dist.all_reduce(counts)
    return counts[0].item() / counts[1].item()


def max_difference(a: nn.Module, b: nn.Module) -> float:
    """The largest |a - b| over all the weights of two models, on any rank."""
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    largest = torch.tensor(max((p - q).abs().max().item() for p, q in pairs))
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


def train(rank: int, world_size: int, steps: int | None = None) -> dict[str, Any]:
    """Train bucketddp and torch DDP side by side for ``steps`` steps (``EPOCHS`` epochs when
    None), on a process group that is already initialized; returns what the demo prints."""
    data = load_digits_split()
    if steps is None:
        steps = EPOCHS * data.steps_per_epoch(world_size)
    systems: dict[str, nn.Module] = {
        "bucketddp": BucketDataParallel(build_model()),
        "torch DDP": DistributedDataParallel(build_model()),
    }
    optimizers = {
        name: torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)
        for name, m in systems.items()
    }
    times: dict[str, list[float]] = {name: [] for name in systems}
    waits: list[float] = []  # bucketddp's exposed wait at the end of each backward
    losses: dict[str, float] = {}
    for step in range(steps):
        x, y = shard(data, step, rank, world_size)
        order = list(systems) if step % 2 == 0 else list(reversed(systems))
        for name in order:
            losses[name], seconds = timed_step(systems[name], optimizers[name], x, y)
            if step >= WARMUP:
                times[name].append(seconds)
                if name == "bucketddp":
                    waits.append(systems[name].comm_stats.wait_seconds)

    ours, theirs = systems["bucketddp"], systems["torch DDP"]
    stats = ours.comm_stats
    return {
        "parameters": sum(p.numel() for p in ours.parameters()),
        "steps": steps,
        "epochs": steps / data.steps_per_epoch(world_size),
        "accuracy": {name: accuracy(m, data, rank, world_size) for name, m in systems.items()},
        "loss": losses,
        "step_seconds": times,
        "max_difference": max_difference(ours.module, theirs.module),
        "buckets": stats.buckets,
        "bytes_reduced": stats.bytes_reduced,
        "wait_seconds": statistics.median(waits) if waits else stats.wait_seconds,
    }


def report(result: dict[str, Any], world_size: int) -> None:
    """Print the comparison table."""
    print(
        f"bucketddp demo: handwritten digits (scikit-learn), an MLP with "
        f"{result['parameters'] / 1e3:.0f}k parameters, {result['steps']} steps "
        f"({result['epochs']:.0f} epochs) of SGD with momentum on {world_size} CPU processes "
        f"(gloo), batch {BATCH} per rank\n"
    )
    names = list(result["accuracy"])
    print(f"{'':28}" + "".join(f"{name:>12}" for name in names))
    accuracies = "".join(f"{100 * result['accuracy'][n]:11.1f}%" for n in names)
    print(f"{'held-out accuracy':28}{accuracies}")
    print(f"{'final loss':28}" + "".join(f"{result['loss'][n]:12.4f}" for n in names))
    medians = {n: 1000 * statistics.median(result["step_seconds"][n]) for n in names}
    print(f"{'median time per step (ms)':28}" + "".join(f"{medians[n]:12.2f}" for n in names))
    print(
        f"\nbucketddp: {result['buckets']} bucket(s), {result['bytes_reduced'] / 2**20:.2f} MB "
        f"reduced per step, {1000 * result['wait_seconds']:.2f} ms median wait after backward"
    )
    ratio = medians["bucketddp"] / medians["torch DDP"]
    print(f"time per step, bucketddp / torch DDP: {ratio:.2f}")
    diff = result["max_difference"]
    print(f"final weights, max |bucketddp - torch DDP|: {diff:.2e}")
    print(f"weights agree: {'yes' if diff <= TOLERANCE else 'no'} (tolerance {TOLERANCE:g})")


def succeeded(result: dict[str, Any]) -> bool:
    """The weights agree and both systems reached the target accuracy."""
    learned = all(a > TARGET_ACCURACY for a in result["accuracy"].values())
    return learned and result["max_difference"] <= TOLERANCE


def run(rank: int, port: int) -> None:
    """One rank: join the group, train both systems, and on rank 0 print the comparison."""
    torch.set_num_threads(1)  # two ranks share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    result = train(rank, WORLD_SIZE)
    if rank == 0:
        report(result, WORLD_SIZE)
    dist.destroy_process_group()
    if not succeeded(result):
        sys.exit(1)


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    """Start the two ranks; the exit status is 0 when the weights agree and both learned."""
    try:
        mp.spawn(run, args=(free_port(),), nprocs=WORLD_SIZE, join=True)
    except mp.ProcessExitedException as e:
        return e.exit_code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
