"""Lightning resume runs for tests/lightning/test_resume.py, one process per "node".

    python tests/support/resume_scenarios.py SCENARIO OUT_DIR [ARGS...]

The test starts every rank itself (``run_nodes`` in test_resume.py), each in a working
directory of its own, ``OUT_DIR/node<R>``, with Lightning's environment variables
(``NODE_RANK``, ``LOCAL_RANK=0``, ...), as if each were alone on a machine with a local
disk: the checkpoints rank 0 writes under the relative ``checkpoints/`` exist in its
directory only. The ranks other than 0 record every file they open whose path contains
"checkpoints" (``sys.addaudithook``), so the test sees whether one ever opened such a file.
``"ddp"`` cannot resume from a file its ranks do not see, so its runs read copies under
``OUT_DIR/shared``. Each rank saves what it observed to ``OUT_DIR/<scenario>.rank<R>.pt``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # lightning_models

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import bucketddp  # noqa: F401  (registers the strategy names)
from bucketddp import BucketDDP
from lightning_models import QUIET, Counting, Observe, _table, weights

torch.set_num_threads(1)

NODES = int(os.environ["WORLD_SIZE"])
"""The world size (read at start: Lightning's environment deletes the variable after a fit)."""

OPENED: list[str] = []
"""Paths containing "checkpoints" this rank opened (recorded on ranks other than 0)."""


def _record_opens() -> None:
    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and "checkpoints" in str(args[0]):
            OPENED.append(str(args[0]))

    if int(os.environ["NODE_RANK"]):
        sys.addaudithook(hook)


class Resumable(Counting):
    """Counting ("sum" and "none" buffers, BatchNorm, Adam), with a stateful or a plain
    loader, extras of its own in the checkpoint, and a note of what it loaded.

    Under DDP Lightning replaces the loader's sampler (torch's SequentialSampler) by its
    DistributedSampler, which shuffles the rows anew each epoch, from the seed and the
    epoch. With ``shuffle`` a StatefulDataLoader shuffles by torchdata's own RandomSampler,
    which Lightning wraps instead. ``workers`` loader processes draw their first indices as
    the loader's iterator is made.
    """

    def __init__(
        self, stateful: bool = True, policies: bool = True, shuffle: bool = False, workers: int = 0
    ) -> None:
        super().__init__(policies=policies)
        self.stateful, self.shuffle, self.workers = stateful, shuffle, workers
        self.loaded_extras: Any = None

    def train_dataloader(self) -> DataLoader[Any]:
        loader = StatefulDataLoader if self.stateful else DataLoader
        rows = _table(32, 1)
        return loader(rows, batch_size=4, shuffle=self.shuffle, num_workers=self.workers)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["extras"] = {"note": "mine", "tensor": torch.full((3,), self.global_step)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_extras = checkpoint.get("extras")


class Tally(pl.Callback):
    """A callback with state: the training batches it saw, saved in the checkpoint."""

    def __init__(self) -> None:
        self.batches = 0
        self.loaded: dict[str, Any] | None = None

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = dict(state_dict)
        self.batches = state_dict["batches"]


def _trainer(
    strategy: Any, max_steps: int, callbacks: list[Any], max_epochs: int | None = None
) -> pl.Trainer:
    options = {**QUIET, "devices": 1, "num_nodes": NODES, "limit_val_batches": 0}
    options.update(strategy=strategy, max_steps=max_steps, callbacks=callbacks)
    options["max_epochs"] = max_epochs
    options["num_sanity_val_steps"] = 0
    if any(isinstance(c, ModelCheckpoint) for c in callbacks):
        options["enable_checkpointing"] = True
    return pl.Trainer(**options)


def _resume(
    strategy: Any, path: str, max_steps: int, max_epochs: int | None = None, **data: Any
) -> dict[str, Any]:
    """Fit from ``path`` to ``max_steps`` (or ``max_epochs``, with ``max_steps=-1``); what
    the run ended with and what it loaded. ``data``: the loader's options (``Resumable``'s
    ``stateful``, ``shuffle``, ``workers``)."""
    # The seed of the saving run: Lightning's DistributedSampler shuffles by it.
    pl.seed_everything(0, verbose=False)
    bucket = not isinstance(strategy, str)
    model = Resumable(policies=bucket, **data)
    with torch.no_grad():  # another start than the saving run's, for the load to undo
        for p in model.parameters():
            p.add_(1.0)
    tally, observe = Tally(), Observe()
    OPENED.clear()
    trainer = _trainer(strategy, max_steps, [tally, observe], max_epochs)
    trainer.fit(model, ckpt_path=path)
    return {
        "weights": weights(model),
        "optimizer": trainer.optimizers[0].state_dict()["state"],
        "global_step": trainer.global_step,
        "extras": model.loaded_extras,
        "tally": tally.loaded,
        "order": observe.seen["train_start"]["bucket_order"],
        "opened": list(OPENED),
    }


def resume(out: Path, ws1_checkpoint: str) -> dict[str, Any]:
    """Resume runs at world size 2 from checkpoints only rank 0 sees, against the run that
    never stopped and against "ddp"; ``ws1_checkpoint`` was saved at world size 1."""
    _record_opens()
    rank = int(os.environ["NODE_RANK"])
    shared = out / "shared"
    result: dict[str, Any] = {"rank": rank}

    # 1. Eight steps straight (two epochs of four), a checkpoint every two steps, with a
    # stateful loader and with a plain one (whose checkpoints hold no loader state).
    for loader in ("stateful", "plain"):
        pl.seed_everything(0, verbose=False)
        model = Resumable(stateful=loader == "stateful")
        saving = ModelCheckpoint(
            dirpath=f"checkpoints/{loader}", every_n_train_steps=2, save_top_k=-1, filename="{step}"
        )
        trainer = _trainer(BucketDDP(), 8, [saving, Tally(), Observe()])
        trainer.fit(model)
        result[f"straight/{loader}"] = {
            "weights": weights(model),
            "optimizer": trainer.optimizers[0].state_dict()["state"],
        }
        if rank == 0:  # copies for "ddp", whose every rank reads the file
            (shared / loader).mkdir(parents=True)
            for step in (2, 4):
                shutil.copy(f"checkpoints/{loader}/step={step}.ckpt", shared / loader)
    trainer.strategy.barrier("copies made")

    # 2. Mid-epoch (step 2) with the stateful loader, and at the epoch boundary (step 4) and
    # mid-epoch with a plain DataLoader: BucketDDP from rank 0's file, "ddp" from copies.
    for label, loader, step in (
        ("stateful_mid", "stateful", 2),
        ("stateful_boundary", "stateful", 4),
        ("plain_boundary", "plain", 4),
        ("plain_mid", "plain", 2),
    ):
        path, stateful = f"{loader}/step={step}.ckpt", loader == "stateful"
        result[label] = _resume(BucketDDP(), f"checkpoints/{path}", 8, stateful=stateful)
        result[f"{label}/ddp"] = _resume("ddp", str(shared / path), 8, stateful=stateful)

    # 3. A "ddp" checkpoint, its keys prefixed "module." as a wrapper's state dict has them.
    pl.seed_everything(0, verbose=False)
    saving = ModelCheckpoint(dirpath="checkpoints/ddp", every_n_train_steps=4, filename="{step}")
    _trainer("ddp", 4, [saving]).fit(Resumable(stateful=False, policies=False))
    if rank == 0:
        ckpt = torch.load("checkpoints/ddp/step=4.ckpt", weights_only=False)
        ckpt["state_dict"] = {f"module.{k}": v for k, v in ckpt["state_dict"].items()}
        torch.save(ckpt, "checkpoints/ddp_prefixed.ckpt")
    result["from_ddp"] = _resume(BucketDDP(), "checkpoints/ddp_prefixed.ckpt", 8, stateful=False)

    # 4. validate, test and predict from a file only rank 0 sees.
    evaluated: dict[str, Any] = {}
    for stage in ("validate", "test", "predict"):
        pl.seed_everything(2, verbose=False)
        model = Resumable()
        OPENED.clear()
        trainer = _trainer(BucketDDP(), 1, [])
        getattr(trainer, stage)(model, ckpt_path="checkpoints/stateful/step=8.ckpt")
        evaluated[stage] = {"weights": weights(model), "opened": list(OPENED)}
    result["evaluated"] = evaluated

    # 5. A checkpoint saved at world size 1 (epoch-boundary), resumed at world size 2.
    if rank == 0:
        shutil.copy(ws1_checkpoint, "checkpoints/ws1.ckpt")
    result["from_ws1"] = _resume(BucketDDP(), "checkpoints/ws1.ckpt", 12, stateful=False)
    result["from_ws1/ddp"] = _resume("ddp", ws1_checkpoint, 12, stateful=False)

    # 6. A path rank 0 does not see either: the same error on every rank, no hang.
    try:
        _resume(BucketDDP(), "checkpoints/missing.ckpt", 8)
        result["missing"] = None
    except FileNotFoundError as err:
        result["missing"] = str(err)
    return result


def at_world_size(out: Path, checkpoint: str) -> dict[str, Any]:
    """Resume a world-size-2 epoch-boundary checkpoint at this world size (3) for two
    steps: BucketDDP from a copy only rank 0 sees, and "ddp" from the file itself."""
    _record_opens()
    if int(os.environ["NODE_RANK"]) == 0:
        os.makedirs("checkpoints")
        shutil.copy(checkpoint, "checkpoints/ws2.ckpt")
    return {
        "bucket": _resume(BucketDDP(), "checkpoints/ws2.ckpt", 6, stateful=False),
        "ddp": _resume("ddp", checkpoint, 6, stateful=False),
    }


LOADERS: dict[str, tuple[str, dict[str, Any]]] = {
    "stateful": ("stateful", {"stateful": True}),
    "stateful_workers": ("stateful_workers", {"stateful": True, "workers": 1}),
    "plain": ("plain", {"stateful": False}),
    "plain_workers": ("plain", {"stateful": False, "workers": 1}),
    "torchdata_shuffle": ("torchdata_shuffle", {"stateful": True, "shuffle": True}),
}
"""The loaders of the ``epochs`` scenario: the straight run whose checkpoints each resumes
from, and Resumable's options."""


def epochs(out: Path, cases: str) -> dict[str, Any]:
    """Resume in epochs 1 and 2, each in its own order, against the run that never stopped.

    Twelve steps straight (three epochs of four) for each loader the cases need, with a
    checkpoint after every step (``step=N``, saved after the batch) and at every epoch's end
    (``epoch=N``, saved in on_train_epoch_end). ``cases``: comma-separated
    ``loader@file[/ddp][/max_epochs]``: resume from ``file`` under BucketDDP (from rank 0's
    file) or "ddp" (every rank reads the file), to step 12 or to the end of epoch 2.
    """
    rank = int(os.environ["NODE_RANK"])
    wanted = [(c.split("@")[0], c.split("@")[1]) for c in cases.split(",")]
    result: dict[str, Any] = {"rank": rank}
    for source in sorted({LOADERS[loader][0] for loader, _ in wanted}):
        pl.seed_everything(0, verbose=False)
        model = Resumable(**LOADERS[source][1])
        where = {"dirpath": f"checkpoints/{source}", "save_top_k": -1}
        steps = ModelCheckpoint(filename="{step}", every_n_train_steps=1, **where)
        ends = ModelCheckpoint(
            filename="{epoch}", every_n_epochs=1, save_on_train_epoch_end=True, **where
        )
        trainer = _trainer(BucketDDP(), 12, [steps, ends])
        trainer.fit(model)
        result[f"straight/{source}"] = {
            "weights": weights(model),
            "optimizer": trainer.optimizers[0].state_dict()["state"],
        }
    trainer.strategy.barrier("checkpoints written")
    for loader, at in wanted:
        file, *flags = at.split("/")
        source, data = LOADERS[loader]
        path = f"checkpoints/{source}/{file}.ckpt"
        ddp = "ddp" in flags
        strategy, path = ("ddp", str(out / "node0" / path)) if ddp else (BucketDDP(), path)
        stop = (-1, 3) if "max_epochs" in flags else (12, None)
        result[f"{loader}@{at}"] = _resume(strategy, path, *stop, **data)
    return result


SCENARIOS = {"resume": resume, "at_world_size": at_world_size, "epochs": epochs}


def main() -> None:
    name, out, *extra = sys.argv[1:]
    result = SCENARIOS[name](Path(out), *extra)
    torch.save(result, Path(out) / f"{name}.rank{os.environ['NODE_RANK']}.pt")


if __name__ == "__main__":
    main()
