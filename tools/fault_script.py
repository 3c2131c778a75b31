"""A training job that fails on purpose: the fault tests and the fault matrix run it.

    python fault_script.py MODE SCENARIO OUT [--stall SECONDS] [--system bucketddp|torch]

MODE is ``loop`` (a hand-written loop; start one process per rank with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, as torchrun does) or ``lightning`` (start rank 0 only;
Lightning's launcher starts the others). SCENARIO is what rank 1 does at step 5:
``raise`` (ValueError), ``kill`` (SIGKILL to itself), ``sleep`` (forever), ``broadcast``
(a ``dist.broadcast`` of its own, on a side group, that rank 0 never joins) or ``none``.
Each rank writes ``OUT/rank<r>.json`` (its pid) when it starts, and rank 1 writes
``OUT/fault.json`` (the time) just before its fault.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

STEPS = 40
FAULT_STEP = 5
SIDE: list[dist.ProcessGroup | None] = [None]  # the side group of ``broadcast``


def _write(path: Path, record: dict[str, float]) -> None:
    """Write ``record`` whole or not at all: the test polls for the file while it runs."""
    part = path.with_suffix(".part")
    part.write_text(json.dumps(record))
    os.replace(part, path)


def fault(scenario: str, out: Path) -> None:
    """Rank 1's fault."""
    _write(out / "fault.json", {"time": time.time()})
    if scenario == "raise":
        raise ValueError("boom at step 5")
    if scenario == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if scenario == "sleep":
        time.sleep(3600)
    if scenario == "broadcast":
        dist.broadcast(torch.zeros(1), src=0, group=SIDE[0])  # rank 0 never comes


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def started(rank: int, out: Path) -> None:
    _write(out / f"rank{rank}.json", {"pid": os.getpid()})


def loop(args: argparse.Namespace) -> None:
    """A hand-written loop: BucketDataParallel (or torch DDP) on gloo."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    SIDE[0] = dist.new_group(backend="gloo")
    started(rank, args.out)
    if args.system == "torch":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model())
    else:
        from bucketddp import BucketDataParallel

        wrapped = BucketDataParallel(model(), stall_timeout=args.stall)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for step in range(1, STEPS + 1):
        if rank == 1 and step == FAULT_STEP and args.scenario != "none":
            fault(args.scenario, args.out)
        loss = wrapped(torch.randn(8, 16)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


def lightning(args: argparse.Namespace) -> None:
    """The same under Lightning's Trainer, started from this script."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    if args.system == "torch":
        strategy: object = "ddp"
    else:
        from bucketddp import BucketDDP

        strategy = BucketDDP(stall_timeout=args.stall, start_method=args.start_method)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,  # type: ignore[arg-type]
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data = TensorDataset(torch.randn(8 * STEPS, 16))
    trainer.fit(Module(args.out, args.scenario), DataLoader(data, batch_size=8))


if sys.argv[1:2] == ["lightning"]:  # at module level, so that spawned ranks can unpickle it
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        """The model of the Lightning jobs; rank 1 faults in its fifth training step."""

        def __init__(self, out: Path, scenario: str) -> None:
            super().__init__()
            self.net = model()
            self.out, self.scenario = out, scenario

        def on_fit_start(self) -> None:
            started(self.global_rank, self.out)

        def training_step(self, batch: list[torch.Tensor], i: int) -> torch.Tensor:
            if self.global_rank == 1 and i + 1 == FAULT_STEP and self.scenario != "none":
                fault(self.scenario, self.out)
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    """Parse the arguments and run the job."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["loop", "lightning"])
    parser.add_argument("scenario", choices=["raise", "kill", "sleep", "broadcast", "none"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--stall", type=float, default=600.0)
    parser.add_argument("--system", choices=["bucketddp", "torch"], default="bucketddp")
    parser.add_argument("--start-method", default="popen", help="BucketDDP's start_method")
    args = parser.parse_args()
    torch.set_num_threads(1)
    (loop if args.mode == "loop" else lightning)(args)


if __name__ == "__main__":
    main()
