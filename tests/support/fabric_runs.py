"""Fabric loops on real ranks: BucketFabricDDP against Fabric's "ddp" and one process.

``all_runs`` runs on every rank of ``multirank.run_ranks``. The ranks carry a torchrun-like
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) and an initialized gloo
group, so ``Fabric(devices=2).launch()`` starts no process and reuses the group, as under
torchrun. Every run builds its model from the same seed and reads the same batches: rank
``r`` trains on rows ``[r*B, (r+1)*B)`` of each global batch of ``2*B`` rows.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from multirank import watchdog_threads, watchdog_threads_after_they_end

WORLD_SIZE = 2
LOCAL_ROWS = 4
STEPS = 4
ADDED_PER_FORWARD = LOCAL_ROWS


class Counted(nn.Module):
    """An MLP with two buffers of our policies: a "sum" counter and a rank-local mark."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        norm: nn.Module = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.net = nn.Sequential(nn.Linear(8, 16), norm, nn.ReLU(), nn.Linear(16, 2))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("local_mark", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += x.shape[0]
        return self.net(x)

    def configure_buffer_sync(self) -> dict[str, str]:
        """Read by BucketDataParallel: "seen" is summed over ranks."""
        return {"seen": "sum"}


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    rows = 2 * LOCAL_ROWS
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 2, generator=g)


def local_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    rows = slice(rank * LOCAL_ROWS, (rank + 1) * LOCAL_ROWS)
    return x[rows], y[rows]


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fabric(strategy: Any) -> Any:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
    fabric.launch()
    return fabric


def _setup(fabric: Any, batchnorm: bool = False, seed: int = 0) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = Counted(batchnorm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return fabric.setup(model, optimizer)


def _loop(fabric: Any, model: Any, optimizer: Any, steps: range, accumulate: int = 1) -> None:
    """``accumulate`` micro-batches per optimizer step, the first ones without sync."""
    rank = dist.get_rank()
    for step in steps:
        for micro in range(accumulate):
            x, y = local_batch(step * accumulate + micro, rank)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                fabric.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _trained(
    strategy: Any, accumulate: int = 1, after_setup: Callable[[Any], Any] | None = None
) -> tuple[Any, Any]:
    fabric = _fabric(strategy)
    model, optimizer = _setup(fabric)
    if after_setup is not None:
        after_setup(model)
    _loop(fabric, model, optimizer, range(STEPS), accumulate)
    return fabric, model


def one_process_with_batchnorm() -> dict[str, torch.Tensor]:
    """BatchNorm on the global batch in one process: what SyncBatchNorm on 2 ranks equals."""
    torch.manual_seed(0)
    model = Counted(batchnorm=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = global_batch(step)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v for k, v in state(model).items() if k.startswith("net.")}


def all_runs(rank: int, world_size: int, out: str) -> dict[str, Any]:
    """Every Fabric case on this rank; returns what the test compares."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from bucketddp import BucketFabricDDP

    torch.manual_seed(0)
    r: dict[str, Any] = {"init": params(Counted())}

    # A plain loop, and the buffer policies: the module's "sum" for "seen", the strategy's
    # "none" for "local_mark", which each rank sets before setup.
    def mark(model: Any) -> None:
        model.module.local_mark.fill_(rank + 1)

    _, ddp = _trained("ddp")
    r["plain/ddp"] = params(ddp.module)
    fabric, bucket = _trained(BucketFabricDDP(buffer_sync={"local_mark": "none"}), 1, mark)
    r["plain/bucket"] = params(bucket.module)
    r["wrapper"] = type(bucket._forward_module).__name__
    r["seen/before_save"] = int(bucket.module.seen)
    path = Path(out) / "plain.ckpt"
    fabric.save(path, {"model": bucket})
    r["seen/after_save"] = int(bucket.module.seen)
    r["local_mark"] = float(bucket.module.local_mark)

    # Accumulation: two micro-batches per step, the first without communication.
    _, ddp = _trained("ddp", accumulate=2)
    r["acc/ddp"] = params(ddp.module)
    fabric = _fabric("bucket_ddp")
    model, optimizer = _setup(fabric)
    x, y = local_batch(0, rank)
    with fabric.no_backward_sync(model):
        fabric.backward(F.mse_loss(model(x), y))
    local = model.module.net[0].weight.grad.clone()
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    r["acc/local_grads_differ"] = not torch.equal(gathered[0], gathered[1])
    optimizer.zero_grad()
    _loop(fabric, model, optimizer, range(STEPS), accumulate=2)
    r["acc/bucket"] = params(model.module)

    # SyncBatchNorm on CPU, against BatchNorm on the global batch in one process.
    fabric = _fabric(BucketFabricDDP(sync_batchnorm=True))
    model, optimizer = _setup(fabric, batchnorm=True)
    r["syncbn/layer"] = type(model.module.net[1]).__name__
    _loop(fabric, model, optimizer, range(STEPS))
    r["syncbn/bucket"] = {k: v for k, v in state(model.module).items() if k.startswith("net.")}
    r["syncbn/one_process"] = one_process_with_batchnorm()

    # A communication hook on CPU, against "ddp" with the same hook on its DDP model.
    fp16 = default_hooks.fp16_compress_hook
    _, ddp = _trained("ddp", 1, lambda m: m._forward_module.register_comm_hook(None, fp16))
    r["fp16/ddp"] = params(ddp.module)
    _, bucket = _trained(BucketFabricDDP(ddp_comm_hook=fp16))
    r["fp16/bucket"] = params(bucket.module)

    r.update(_post_local_sgd(rank))
    r.update(_loader_epochs(Path(out)))
    r.update(_round_trip(rank, Path(out)))
    del fabric, ddp, bucket, model, optimizer
    r.update(_teardown())
    return r


def _teardown() -> dict[str, int]:
    """Watchdog threads: with no module set up, with one, and after the strategy's teardown."""
    gc.collect()  # the modules of the runs above: collected, so no longer watched
    out = {"watchdogs/before": watchdog_threads_after_they_end()}  # each at its next beat
    fabric = _fabric("bucket_ddp")
    model, optimizer = _setup(fabric)
    _loop(fabric, model, optimizer, range(1))
    out["watchdogs/running"] = watchdog_threads()
    fabric.strategy.teardown()
    out["watchdogs/after_teardown"] = watchdog_threads()
    return out


def _post_local_sgd(rank: int) -> dict[str, Any]:
    """Post-local SGD (local from step 2, averaging every 3) against torch DDP with the
    same hook and torch's averager in the loop."""
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as local_sgd
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    from bucketddp import BucketFabricDDP

    def new_state() -> Any:
        return local_sgd.PostLocalSGDState(
            None, None, start_localSGD_iter=2, post_local_gradient_allreduce=False
        )

    hook = local_sgd.post_localSGD_hook
    fabric = _fabric("ddp")
    model, optimizer = _setup(fabric)
    model._forward_module.register_comm_hook(new_state(), hook)
    averager = PeriodicModelAverager(period=3, warmup_steps=2)
    for step in range(2 * STEPS):
        x, y = local_batch(step, rank)
        fabric.backward(F.mse_loss(model(x), y))
        optimizer.step()
        averager.average_parameters(model.parameters())  # before zero_grad: it needs .grad
        optimizer.zero_grad()
    out = {"local_sgd/ddp": params(model.module)}
    strategy = BucketFabricDDP(
        ddp_comm_state=new_state(), ddp_comm_hook=hook, model_averaging_period=3
    )
    fabric = _fabric(strategy)
    model, optimizer = _setup(fabric)
    _loop(fabric, model, optimizer, range(2 * STEPS))
    out["local_sgd/bucket"] = params(model.module)
    return out


def _loader_epochs(out: Path) -> dict[str, Any]:
    """The rows a loop reads in epochs 0 to 2, and from a save after 6 batches (in epoch 1)
    on: with a shuffled StatefulDataLoader set up by ``fabric.setup_dataloaders``, and with
    one whose DistributedSampler is the loop's own, its epoch set by the loop."""
    from torch.utils.data import DistributedSampler, RandomSampler, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from bucketddp import BucketFabricDDP

    fabric = _fabric(BucketFabricDDP())
    rows = TensorDataset(torch.arange(32))

    def loader(own: bool) -> Any:
        if own:
            sampler = DistributedSampler(rows, fabric.world_size, fabric.global_rank, seed=0)
            return StatefulDataLoader(rows, batch_size=4, sampler=sampler)
        return fabric.setup_dataloaders(
            StatefulDataLoader(rows, batch_size=4, sampler=RandomSampler(rows))
        )

    def read(data: Any, own: bool, state: dict[str, Any], path: Path | None = None) -> list[Any]:
        seen = []
        for epoch in range(state["epoch"], 3):
            if own:
                data.sampler.set_epoch(epoch)
            for (x,) in data:
                seen.append(x.tolist())
                if path is not None and len(seen) == 6:
                    fabric.save(path, {**state, "epoch": epoch})
        return seen

    result: dict[str, Any] = {}
    for own, name in ((False, "fabric"), (True, "own")):
        path, data = out / f"epochs_{name}.ckpt", loader(own)
        result[f"epochs/{name}/straight"] = read(data, own, {"loader": data, "epoch": 0}, path)
        state = {"loader": loader(own), "epoch": 0}
        fabric.load(path, state)
        result[f"epochs/{name}/resumed"] = read(state["loader"], own, state)
    return result


def _round_trip(rank: int, out: Path) -> dict[str, Any]:
    """Train 4 steps, save, train 4 more; a new model loaded from the file trains the same.

    Each rank works in a directory of its own, so the file rank 0 writes under a relative
    path is rank 0's alone: the other rank receives it in ``fabric.load``, and records
    every file it opens to show it never opened that one.
    """
    os.makedirs(out / f"rank{rank}")
    os.chdir(out / f"rank{rank}")
    opened: list[str] = []
    if rank:
        sys.addaudithook(lambda e, a: opened.append(str(a[0])) if e == "open" else None)
    fabric = _fabric("bucket_ddp")
    model, optimizer = _setup(fabric)
    _loop(fabric, model, optimizer, range(STEPS))
    fabric.save("resume.ckpt", {"model": model, "optimizer": optimizer, "step": STEPS})
    saved_order = model._forward_module.bucket_order
    _loop(fabric, model, optimizer, range(STEPS, 2 * STEPS))
    result: dict[str, Any] = {"straight": params(model.module), "saved_order": saved_order}

    fabric = _fabric("bucket_ddp")
    model, optimizer = _setup(fabric, seed=1)  # other initial weights, overwritten by load
    state = {"model": model, "optimizer": optimizer, "step": 0}
    result["remainder"] = fabric.load("resume.ckpt", state)
    result["loaded_step"] = state["step"]
    result["adopted_order"] = model._forward_module.bucket_order
    _loop(fabric, model, optimizer, range(STEPS, 2 * STEPS))
    result["resumed"] = params(model.module)
    fabric.save(out / "resumed.ckpt", {"model": model})  # syncs the "sum" buffer
    result["resumed_seen"] = int(model.module.seen)

    # Weights saved from a wrapper, every key "module.*", load into the model: a raw state
    # dict, through fabric.load_raw, from rank 0's file too.
    if rank == 0:
        saved = torch.load("resume.ckpt", weights_only=True)["model"]
        torch.save({f"module.{k}": v for k, v in saved.items()}, "prefixed.ckpt")
    model, optimizer = _setup(fabric, seed=2)
    fabric.load_raw("prefixed.ckpt", model)
    result["prefixed"] = params(model.module)
    result["opened"] = [p for p in opened if "resume.ckpt" in p or "prefixed.ckpt" in p]
    return result
