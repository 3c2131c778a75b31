"""Lightning under torchrun with elastic snapshots: run by tests/lightning/test_elastic_trainer.py.

``python elastic_lightning.py MODE OUT KILL`` on 2 workers: a Trainer fit of 24 steps (8 an
epoch) with ``BucketDDP(elastic=True)`` and a plain DataLoader (``trainer``) or a
StatefulDataLoader (``stateful``), either with a sampler of the user's under
``ELASTIC_SAMPLER`` (``subclass``: a ``DistributedSampler`` subclass passed with
``use_distributed_sampler=False``; ``weighted``: a ``WeightedRandomSampler`` drawing from
the global generator, which Lightning wraps for the ranks; the loader made again every
epoch under ``ELASTIC_RELOAD=1``), the Trainer fit with
``accumulate_grad_batches=2`` (``accumulate``: 12 steps, and the kill comes in the second
batch of step ``KILL + 1``), the Trainer fit validating every 4 steps (``validate``: the
kill comes in the validation run after step ``KILL``), or the same loop under Fabric with
``BucketFabricDDP(elastic=True)`` (``fabric``; its loader through ``fab.setup_dataloaders``
under ``ELASTIC_FABRIC_LOADER``: ``fabric``, a shuffled loader whose sampler Fabric makes,
with no generator of its own;
``own``, the loop's ``ElasticSampler``; or ``stateful``: that sampler in a StatefulDataLoader in
the loop's state, not set up). In attempt 0, rank 1 kills itself
(SIGKILL) when ``KILL`` steps are done; under ``ELASTIC_SIGNAL=TERM`` rank
``ELASTIC_SIGNAL_RANK`` sends itself SIGTERM then instead (``elastic_loop.notice_due``).
Each rank logs the steps it completes to ``OUT/steps.rank<R>``; rank 0 saves the final
weights to ``OUT/final.pt``. Under ``ELASTIC_AFTER_FIT=1``, rank 1 is SIGKILLed in attempt 0
after ``fit()`` returned instead (``elastic_loop.after_fit``). Nothing else is written: no
logger, no checkpoint callback. Mode ``checkpoint`` instead saves a checkpoint after step
``KILL`` and resumes a new fit from it with ``ckpt_path`` (no kill, no elastic). Under
``ELASTIC_POWERSGD=1`` the strategy reduces with torch's ``powerSGD_hook`` (rank 1,
compressing from step 2), whose state must survive the restart too.

Mode ``nodes`` runs one worker per torchrun agent (node), at whatever world size the round
has: each process logs the rows it trains on to ``OUT/rows.rank<R>.pid<P>`` and, at the
end, its world size and ``"sum"`` buffer to ``OUT/done.rank<R>``. The agent's worker named
by ``ELASTIC_VICTIM=1`` kills itself and its agent when ``KILL`` steps are done; under
``ELASTIC_GROW_AT=N``, a worker alone in its round stops in step ``N + 1`` until a joining
agent makes torchrun stop it (``wait_for_a_joiner``). ``ELASTIC_SAMPLER`` applies to it too.
``ELASTIC_WORKERS=N`` gives the training loaders ``N`` worker processes (none by default),
which the Trainer's loader keeps from epoch to epoch under ``ELASTIC_PERSISTENT=1``.
Under ``ELASTIC_LOADERS=2`` the Trainer trains on two loaders: ``a`` in batches of 4 (8 a
pass; its sampler is ``ELASTIC_SAMPLER``'s), and ``b`` in batches of 3 (11 a pass, the
epoch's length), combined in Lightning's default mode for training or in
``ELASTIC_LOADERS_MODE``; in mode ``nodes``, ``b``'s rows are logged as 100 and up.
Mode ``fabric_nodes`` is ``nodes`` under Fabric, with a shuffled loader through
``fab.setup_dataloaders`` and the rows counted over the ranks in the job's state.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.pytorch.utilities import CombinedLoader
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.utils.data import DataLoader

from bucketddp import BucketDDP, BucketFabricDDP
from bucketddp.elastic import ElasticSampler
from bucketddp.notice import NOTICE
from elastic_loop import BATCH, EPOCHS, after_fit, attempt_of_job, dataset, notice_due

ATTEMPT = attempt_of_job()
WORKERS = int(os.environ.get("ELASTIC_WORKERS", "0"))  # the loaders' worker processes


def _net(dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(0)
    # BatchNorm's statistics are "broadcast" buffers: a snapshot takes each rank's own.
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.BatchNorm1d(32),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(32, 2),
    )


def _hook() -> dict[str, Any]:
    """The strategy's comm hook options: PowerSGD under ``ELASTIC_POWERSGD=1``, else none."""
    if os.environ.get("ELASTIC_POWERSGD") != "1":
        return {}
    state = powerSGD.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    return {"ddp_comm_state": state, "ddp_comm_hook": powerSGD.powerSGD_hook}


def _kill_if_due(rank: int, done: int, kill: int) -> None:
    if notice_due(rank, done, kill):
        return
    if ATTEMPT == 0 and rank == 1 and done == kill:
        os.kill(os.getpid(), signal.SIGKILL)


class Module(pl.LightningModule):
    def __init__(self, out: str, kill: int, stateful: bool) -> None:
        super().__init__()
        self.net = _net()
        self.out, self.kill, self.stateful = out, kill, stateful

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # Accumulating, the kill comes in the batch that completes the step.
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:
            _kill_if_due(self.global_rank, self.trainer.global_step, self.kill)
        if isinstance(batch, dict):  # two loaders: a batch of each (None: one that ran out)
            given = [part for part in batch.values() if part is not None]
            batch = [torch.cat(parts) for parts in zip(*given, strict=True)]
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> Any:
        loader: Any = DataLoader
        if self.stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            loader = StatefulDataLoader
        if os.environ.get("ELASTIC_LOADERS") == "2":
            # 8 batches a pass, started over within the epoch of 11 that b makes.
            a = loader(dataset(), batch_size=BATCH, num_workers=WORKERS, **_sampler())
            loaders = {"a": a, "b": loader(dataset(), batch_size=3, num_workers=WORKERS)}
            mode = os.environ.get("ELASTIC_LOADERS_MODE")
            return CombinedLoader(loaders, mode) if mode else loaders
        persistent = os.environ.get("ELASTIC_PERSISTENT") == "1"
        return loader(
            dataset(),
            batch_size=BATCH,
            num_workers=WORKERS,
            persistent_workers=persistent,
            **_sampler(),
        )


class _Subclass(torch.utils.data.DistributedSampler):
    """A user's own ``DistributedSampler``, which Lightning leaves in place."""


def _sampler() -> dict[str, Any]:
    """The loader's ``sampler`` under ``ELASTIC_SAMPLER``; none by default."""
    kind = os.environ.get("ELASTIC_SAMPLER")
    if kind == "subclass":
        return {"sampler": _Subclass(dataset(), shuffle=True, seed=3)}
    if kind == "weighted":
        weights = torch.linspace(0.1, 1.0, len(dataset()))
        return {"sampler": torch.utils.data.WeightedRandomSampler(weights, len(weights))}
    return {}


class Validating(Module):
    """Validates every 4 steps, mid-epoch (2 batches, the loss logged across ranks), and
    logs each run to ``OUT/val.rank<R>``; the kill comes in the validation run after step
    ``kill`` instead of a training step (a stop signal, in the step after ``kill``)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        notice_due(self.global_rank, self.trainer.global_step, self.kill)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0 and not self.trainer.sanity_checking:
            with open(f"{self.out}/val.rank{self.global_rank}", "a") as log:
                print(f"val {self.trainer.global_step} attempt {ATTEMPT}", file=log)
        _kill_if_due(self.global_rank, self.trainer.global_step, self.kill)
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def val_dataloader(self) -> Any:
        return DataLoader(dataset(), batch_size=BATCH)


class StepLog(pl.Callback):
    """Logs each step done; a user's callback, so it runs before BucketDDP's snapshot one."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        with open(f"{self.out}/steps.rank{trainer.global_rank}", "a") as log:
            print(f"step {trainer.global_step} attempt {ATTEMPT}", file=log)


def trainer(
    out: str, kill: int, stateful: bool, accumulate: int = 1, validate: bool = False
) -> None:
    model = Validating(out, kill, stateful) if validate else Module(out, kill, stateful)
    every = {"val_check_interval": 4, "limit_val_batches": 2} if validate else {}
    fit = pl.Trainer(
        **every,
        accelerator="cpu",
        devices=2,
        strategy=BucketDDP(elastic=True, **_hook()),
        max_steps=EPOCHS * 8 // accumulate,
        accumulate_grad_batches=accumulate,
        callbacks=[StepLog(out)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        use_distributed_sampler=os.environ.get("ELASTIC_SAMPLER") != "subclass",
        reload_dataloaders_every_n_epochs=int(os.environ.get("ELASTIC_RELOAD", "0")),
    )
    fit.fit(model)
    if fit.global_rank == 0:
        torch.save(model.net.state_dict(), f"{out}/final.pt")
    after_fit(out, fit.global_rank, ATTEMPT, fit.global_step)


def fabric(out: str, kill: int) -> None:
    fab = Fabric(accelerator="cpu", devices=2, strategy=BucketFabricDDP(elastic=True, **_hook()))
    fab.launch()
    net = _net()
    model, opt = fab.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    data = dataset()
    setup = os.environ.get("ELASTIC_FABRIC_LOADER")
    if setup == "fabric":  # Fabric's own sampler, from a shuffled loader: seed 0, as below
        # No generator of its own: each iterator's seed comes from the global generator.
        loader = DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=WORKERS)
        loader = fab.setup_dataloaders(loader)
        sampler = loader.sampler
    else:
        sampler = ElasticSampler(data, shuffle=True, seed=0)
        loader = DataLoader(
            data, BATCH, sampler=sampler, generator=torch.Generator(), num_workers=WORKERS
        )
        if setup == "own":
            loader = fab.setup_dataloaders(loader)
    state = {"model": model, "optimizer": opt, "epoch": 0}
    if setup == "stateful":  # the loop's sampler, in a StatefulDataLoader in the state
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(
            data, BATCH, sampler=sampler, generator=torch.Generator(), num_workers=WORKERS
        )
        state["loader"] = loader
    job = fab.strategy.elastic(state, sampler=sampler, batch_size=BATCH)
    job.resume()
    rank = fab.global_rank
    with open(f"{out}/steps.rank{rank}", "a") as log:
        while state["epoch"] < EPOCHS:
            sampler.set_epoch(state["epoch"])
            for x, y in loader:
                _kill_if_due(rank, job.steps, kill)
                fab.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
                print(f"step {job.steps + 1} attempt {ATTEMPT}", file=log, flush=True)
                job.step()
            state["epoch"] += 1
    job.finish()
    if rank == 0:
        torch.save(net.state_dict(), f"{out}/final.pt")
    after_fit(out, rank, ATTEMPT, job.steps)


class SaveAt(pl.Callback):
    """Saves a checkpoint after step ``step``, as ``ModelCheckpoint(every_n_train_steps)``."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def checkpoint(out: str, at: int) -> None:
    """A fit of 24 steps (no elastic, no dropout) saving a checkpoint after step ``at``, then
    a new fit (new module, optimizer and comm hook state) from it: ``OUT/straight.pt`` and
    ``OUT/final.pt`` hold each one's final weights."""
    for name, ckpt in (("straight", None), ("final", f"{out}/step{at}.ckpt")):
        model = Module(out, -1, stateful=False)
        model.net = _net(dropout=0.0)
        fit = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=BucketDDP(**_hook()),
            max_steps=EPOCHS * 8,
            callbacks=[StepLog(out)] if ckpt else [SaveAt(at, f"{out}/step{at}.ckpt")],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=out,
        )
        fit.fit(model, ckpt_path=ckpt)
        if fit.global_rank == 0:
            torch.save(model.net.state_dict(), f"{out}/{name}.pt")


class Counting(pl.LightningModule):
    """Logs the rows it trains on; its ``seen`` buffer sums them over the ranks."""

    def __init__(self, out: str, kill: int) -> None:
        super().__init__()
        self.net = _net()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.out, self.kill = out, kill

    def configure_buffer_sync(self) -> dict[str, str]:
        return {"seen": "sum"}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        _die_if_victim(step, self.kill)
        if self.trainer.world_size == 1 and step == int(os.environ.get("ELASTIC_GROW_AT", -1)):
            wait_for_a_joiner(self.out)
        if isinstance(batch, dict):  # two loaders: b's rows are logged as 100 and up
            parts = [batch[name] for name in ("a", "b") if batch.get(name) is not None]
            if len(parts) == 2:
                parts[1] = [parts[1][0] + 100, *parts[1][1:]]
            batch = [torch.cat(columns) for columns in zip(*parts, strict=True)]
        index, x, y = batch
        self.seen += len(index)
        rows = " ".join(str(int(i)) for i in index)
        with open(f"{self.out}/rows.rank{self.global_rank}.pid{os.getpid()}", "a") as log:
            print(f"{step} {self.current_epoch} {rows}", file=log)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> Any:
        if os.environ.get("ELASTIC_LOADERS") == "2":
            loaders = {"a": DataLoader(_indexed(), BATCH), "b": DataLoader(_indexed(), 3)}
            mode = os.environ.get("ELASTIC_LOADERS_MODE")
            return CombinedLoader(loaders, mode) if mode else loaders
        return DataLoader(_indexed(), batch_size=BATCH, **_sampler())


def _indexed() -> torch.utils.data.Dataset[Any]:
    """The dataset with each row's index first."""
    rows = dataset().tensors
    return torch.utils.data.TensorDataset(torch.arange(len(rows[0])), *rows)


def _die_if_victim(step: int, kill: int) -> None:
    """In attempt 0, the worker of the agent under ``ELASTIC_VICTIM=1`` kills that agent and
    itself once ``kill`` steps are done: a node lost."""
    if ATTEMPT == 0 and os.environ.get("ELASTIC_VICTIM") == "1" and step == kill:
        os.kill(os.getppid(), signal.SIGKILL)  # this node's agent, then this worker
        os.kill(os.getpid(), signal.SIGKILL)


def wait_for_a_joiner(out: str) -> None:
    """Say so (``OUT/waiting``), then wait in this step until torchrun's agent, which a new
    agent has joined, sends its stop signal (a hang guard of 120 s)."""
    Path(f"{out}/waiting").touch()
    deadline = time.monotonic() + 120
    while not NOTICE.pending:
        if time.monotonic() > deadline:
            raise RuntimeError("no agent joined within 120 s")
        time.sleep(0.05)


def nodes(out: str, kill: int) -> None:
    """One worker per node, on one or two nodes: the epoch goes on at the size left."""
    model = Counting(out, kill)
    fit = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=int(os.environ["WORLD_SIZE"]),
        strategy=BucketDDP(elastic=True),
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    fit.fit(model)
    with open(f"{out}/done.rank{fit.global_rank}", "w") as f:
        print(f"world {fit.world_size} seen {int(model.seen)}", file=f)


def fabric_nodes(out: str, kill: int) -> None:
    """``nodes`` under Fabric: Fabric's own sampler, from a shuffled loader through
    ``fab.setup_dataloaders``, and the loop's ``seen`` counter in the job's state."""
    fab = Fabric(
        accelerator="cpu",
        devices=1,
        num_nodes=int(os.environ["WORLD_SIZE"]),
        strategy=BucketFabricDDP(elastic=True),
    )
    fab.launch()
    net = _net()
    model, opt = fab.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    loader = fab.setup_dataloaders(DataLoader(_indexed(), batch_size=BATCH, shuffle=True))
    state = {"model": model, "optimizer": opt, "epoch": 0, "seen": 0}
    job = fab.strategy.elastic(state, sampler=loader.sampler, batch_size=BATCH)
    job.resume()
    rank = fab.global_rank
    while state["epoch"] < EPOCHS:
        for index, x, y in loader:
            _die_if_victim(job.steps, kill)
            fab.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            state["seen"] += int(fab.all_reduce(torch.tensor(len(index)), reduce_op="sum"))
            rows = " ".join(str(int(i)) for i in index)
            with open(f"{out}/rows.rank{rank}.pid{os.getpid()}", "a") as log:
                print(f"{job.steps} {state['epoch']} {rows}", file=log)
            job.step()
        state["epoch"] += 1
    job.finish()
    with open(f"{out}/done.rank{rank}", "w") as f:
        print(f"world {fab.world_size} seen {state['seen']}", file=f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out, kill = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "fabric":
        fabric(out, kill)
    elif mode == "checkpoint":
        checkpoint(out, kill)
    elif mode == "nodes":
        nodes(out, kill)
    elif mode == "fabric_nodes":
        fabric_nodes(out, kill)
    else:
        accumulate = 2 if mode == "accumulate" else 1
        trainer(out, kill, mode == "stateful", accumulate, validate=mode == "validate")
    if dist.is_initialized():
        dist.destroy_process_group()
