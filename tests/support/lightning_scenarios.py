"""Lightning runs for tests/lightning/test_strategy.py, each a standalone script.

    python tests/support/lightning_scenarios.py SCENARIO OUT_DIR [CHECKPOINT]

A scenario builds ``Trainer(accelerator="cpu", devices=N, ...)`` and lets Lightning's own
launcher start the other ranks (it re-runs this script with the same arguments), exactly
as a user's training script runs. Every rank saves what it observed to
``OUT_DIR/<scenario>.rank<R>.pt``; the test reads those files. One scenario runs several
Trainers one after another in the same processes, so that one launch checks many things.
"""

from __future__ import annotations

import csv
import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # lightning_models, multirank

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook

import bucketddp
from bucketddp import BucketDDP
from lightning_models import (
    GAN,
    MLP,
    QUIET,
    Boring,
    CountAllReduces,
    Counting,
    Finetuned,
    GradNorms,
    ManualBatchNorm,
    NanOnRank1,
    Normed,
    Observe,
    RankLocalBias,
    RecordingCheckpointIO,
    RegisterCommHook,
    SyncedBatches,
    Transformer,
    Unused,
    WrapperAttribute,
    Zero,
    hook_count,
    weights,
)
from multirank import watchdog_threads

torch.set_num_threads(1)


def _fit(
    strategy: Any,
    make: Callable[[], pl.LightningModule],
    *,
    seed: int = 0,
    devices: int = 2,
    **trainer_kwargs: Any,
) -> tuple[pl.Trainer, pl.LightningModule]:
    pl.seed_everything(seed, verbose=False)
    model = make()
    options = {**QUIET, "devices": devices, "strategy": strategy, **trainer_kwargs}
    trainer = pl.Trainer(**options)
    trainer.fit(model)
    return trainer, model


# ----------------------------------------------------------------------------- swap
def swap(out: Path) -> dict[str, Any]:
    """The same runs under strategy="ddp" and BucketDDP: the weights must match."""
    result: dict[str, Any] = {}
    fit = functools.partial(_fit, limit_val_batches=0)
    runs: list[tuple[str, Callable[[], pl.LightningModule], dict[str, Any]]] = [
        ("boring", Boring, {"max_steps": 6}),
        ("boring_acc2", Boring, {"max_steps": 3, "accumulate_grad_batches": 2}),
        ("boring_bf16", Boring, {"max_steps": 4, "precision": "bf16-mixed"}),
        ("transformer", Transformer, {"max_steps": 3}),
        ("transformer_acc2", Transformer, {"max_steps": 2, "accumulate_grad_batches": 2}),
    ]
    for name, make, kwargs in runs:
        pl.seed_everything(0, verbose=False)
        result[f"{name}/init"] = weights(make())
        for label, strategy in (("ddp", "ddp"), ("bucket", BucketDDP(bucket_cap_mb=0.5))):
            _, model = fit(strategy, make, **kwargs)
            result[f"{name}/{label}"] = weights(model)
    # Clipping must see the reduced gradients: the norms agree across ranks and with "ddp".
    for label, strategy in (("ddp", "ddp"), ("bucket", "bucket_ddp")):
        norms = GradNorms()
        _, model = fit(strategy, Boring, max_steps=4, gradient_clip_val=0.05, callbacks=[norms])
        result[f"clip/{label}"] = weights(model)
        result[f"clip_norms/{label}"] = norms.norms
    # Manual optimization, two optimizers, toggle_model(sync_grad=...) accumulation.
    # toggle_model freezes the other optimizer's parameters on every rank, which BucketDDP
    # follows without find_unused_parameters ("bucket_default"); "ddp" needs the flag.
    for label, strategy in (
        ("ddp", "ddp_find_unused_parameters_true"),
        ("bucket", "bucket_ddp_find_unused_parameters_true"),
        ("bucket_default", BucketDDP()),
    ):
        synced = SyncedBatches()
        _, model = fit(strategy, GAN, max_steps=8, callbacks=[synced])
        result[f"gan/{label}"] = weights(model)
        result[f"gan_synced/{label}"] = synced.batches
    # Manual optimization with BatchNorm: BucketDDP syncs buffers before each training_step
    # as in automatic optimization; "ddp" stops after the first one (Lightning's forward
    # redirection clears require_backward_grad_sync before torch DDP's post-forward).
    for label, strategy in (("ddp", "ddp"), ("bucket", BucketDDP())):
        _, model = fit(strategy, ManualBatchNorm, max_steps=6)
        result[f"manual_bn/{label}"] = weights(model)
        result[f"manual_bn_seen/{label}"] = model.seen
    # fp16 gradient compression: "ddp" gets the hook from a callback (Lightning registers
    # ddp_comm_hook only on CUDA), BucketDDP from its ddp_comm_hook option.
    fp16 = default_hooks.fp16_compress_hook
    for label, strategy, callbacks in (
        ("ddp", "ddp", [RegisterCommHook(fp16)]),
        ("bucket", BucketDDP(ddp_comm_hook=fp16), []),
    ):
        _, model = fit(strategy, Boring, max_steps=6, callbacks=callbacks)
        result[f"fp16/{label}"] = weights(model)
    # static_graph=True reaches the wrapper, and trains as DDPStrategy(static_graph=True).
    for label, strategy in (
        ("ddp", DDPStrategy(static_graph=True)),
        ("bucket", BucketDDP(static_graph=True)),
    ):
        static = WrapperAttribute("static_graph")
        _, model = fit(strategy, Boring, max_steps=4, callbacks=[static])
        result[f"static/{label}"] = weights(model)
        result[f"static_flag/{label}"] = static.value
    # Post-local SGD: averaged gradients for 2 steps, then local ones, with the parameters
    # averaged every 3 optimizer steps. "ddp" gets the hook from a callback (Lightning
    # registers it only on CUDA); both get model averaging from the strategy.
    for label in ("ddp", "bucket"):
        state = post_localSGD_hook.PostLocalSGDState(
            None, None, start_localSGD_iter=2, post_local_gradient_allreduce=False
        )
        options = {
            "ddp_comm_state": state,
            "ddp_comm_hook": post_localSGD_hook.post_localSGD_hook,
            "model_averaging_period": 3,
        }
        if label == "ddp":
            hooked = RegisterCommHook(post_localSGD_hook.post_localSGD_hook, state)
            _, model = fit(DDPStrategy(**options), Boring, max_steps=6, callbacks=[hooked])
        else:
            _, model = fit(BucketDDP(**options), Boring, max_steps=6)
        result[f"local_sgd/{label}"] = weights(model)
    # A parameter in the module's _ddp_params_and_buffers_to_ignore stays rank-local.
    for label, strategy in (("ddp", "ddp"), ("bucket", BucketDDP())):
        _, model = fit(strategy, RankLocalBias, max_steps=4)
        result[f"ignored/{label}"] = weights(model)
    # A model compiled before fit: Lightning compiles its training_step, the strategy wraps.
    for label, strategy in (("ddp", "ddp"), ("bucket", BucketDDP())):
        result[f"compiled/{label}"], result[f"compiled_graphs/{label}"] = _compiled(strategy)
    # A backbone unfrozen at epoch 1 by BackboneFinetuning (compared with finetune_single).
    result["finetune/init"] = _finetune("init")
    for label, strategy in (("ddp", "ddp"), ("bucket", BucketDDP())):
        result[f"finetune/{label}"] = _finetune(strategy)
    # accumulate_grad_batches=2 communicates once per two batches: count the all-reduces.
    for acc in (1, 2):
        count, synced = CountAllReduces(), SyncedBatches()
        fit(
            BucketDDP(bucket_cap_mb=0.01, first_bucket_mb=0.01),
            MLP,
            max_steps=8 // acc,
            accumulate_grad_batches=acc,
            callbacks=[count, synced],
        )
        result[f"allreduces/acc{acc}"] = count.count
        result[f"synced/acc{acc}"] = synced.batches
        result[f"buckets/acc{acc}"] = count.buckets
    return result


def _compiled(strategy: Any) -> tuple[dict[str, torch.Tensor], int]:
    """Weights after fitting ``torch.compile(Boring())``, and the graphs Dynamo compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compile_boring = lambda: torch.compile(Boring(), backend="aot_eager")  # noqa: E731
    _, compiled = _fit(strategy, compile_boring, max_steps=4, limit_val_batches=0)
    return weights(compiled._orig_mod), counters["stats"]["unique_graphs"]


def _finetune(strategy: Any, devices: int = 2) -> dict[str, torch.Tensor]:
    """Weights after three epochs of Finetuned with BackboneFinetuning ("init": before)."""
    make = functools.partial(Finetuned, batch_size=8 // devices, global_batches=devices == 1)
    if strategy == "init":
        pl.seed_everything(0, verbose=False)
        return weights(make())
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    _, model = _fit(
        strategy,
        make,
        devices=devices,
        max_epochs=3,
        limit_val_batches=0,
        callbacks=[finetuning],
    )
    return weights(model)


def finetune_single(out: Path) -> dict[str, Any]:
    """The ground truth of the swap scenario's finetune runs: one process, global batches."""
    return {"single": _finetune("auto", devices=1)}


# ------------------------------------------------------------------------ lifecycle
def lifecycle(out: Path) -> dict[str, Any]:
    """Fit with checkpoints, resume, validate/test/predict, SyncBatchNorm and errors."""
    result: dict[str, Any] = {}
    ckpt_dir = out / "checkpoints"

    # 1. Eight steps straight.
    observe = Observe()
    trainer, model = _fit(
        BucketDDP(),
        Counting,
        max_steps=8,
        callbacks=[observe],
        limit_val_batches=2,
        num_sanity_val_steps=0,
    )
    result["straight"] = weights(model)
    result["straight_optimizer"] = trainer.optimizers[0].state_dict()
    result["after_fit"] = {
        "is_plain": trainer.strategy.model is model,
        "hooks": hook_count(model),
        "watchdogs": watchdog_threads(),
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }

    # 2. Validate, test and predict with the same trainer and module: no wrapper attached.
    result["validate"] = trainer.validate(model, verbose=False)
    result["test"] = trainer.test(model, verbose=False)
    trainer.predict(model)
    result["observed"] = observe.seen
    result["eval_hooks"] = hook_count(model)

    # 3. The same eight steps with a checkpoint every four, through the registered name.
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, every_n_train_steps=4, save_top_k=-1, filename="{step}"
    )
    trainer, model = _fit(
        "bucket_ddp",
        Counting,
        max_steps=8,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        enable_checkpointing=True,
        callbacks=[checkpoint],
        plugins=[RecordingCheckpointIO(str(out))],
    )
    result["checkpointed"] = weights(model)
    step4 = ckpt_dir / "step=4.ckpt"

    # 4. Resume from step 4 to step 8 with BucketDDP, then with torch DDP.
    observe = Observe()
    pl.seed_everything(0, verbose=False)
    model = Counting()
    trainer = pl.Trainer(
        **QUIET,
        devices=2,
        strategy=BucketDDP(),
        max_steps=8,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        callbacks=[observe],
    )
    trainer.fit(model, ckpt_path=step4)
    result["resumed"] = weights(model)
    result["resumed_optimizer"] = trainer.optimizers[0].state_dict()
    result["resume_observed"] = observe.seen

    pl.seed_everything(0, verbose=False)
    model = Counting(policies=False)
    trainer = pl.Trainer(
        **QUIET, devices=2, strategy="ddp", max_steps=8, limit_val_batches=2, num_sanity_val_steps=0
    )
    trainer.fit(model, ckpt_path=step4)
    result["resumed_torch_ddp"] = weights(model)

    # 5. SyncBatchNorm through Trainer(sync_batchnorm=True) and through BucketDDP's flag.
    for label, strategy, flag in (
        ("trainer_flag", BucketDDP(), True),
        ("strategy_flag", BucketDDP(sync_batchnorm=True), False),
    ):
        observe = Observe()
        trainer, model = _fit(
            strategy, Normed, max_steps=4, sync_batchnorm=flag, callbacks=[observe]
        )
        after = sorted(
            type(m).__name__
            for m in model.modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        )
        trainer.predict(model)  # outside of fit nothing is converted
        result[f"syncbn/{label}"] = {
            "during": observe.seen["train_start"]["norm_layers"],
            "after": after,
            "predict": observe.seen["predict"]["norm_layers"],
            "state": weights(model),
        }

    # 6. ZeroRedundancyOptimizer, and a checkpoint saved after fit by every rank's call.
    trainer, model = _fit(BucketDDP(), Zero, max_steps=2, limit_val_batches=0)
    path = trainer.strategy.broadcast(str(out / "after_fit.ckpt"))
    trainer.save_checkpoint(path)
    result["zero"] = {"weights": weights(model), "path": path}

    # 7. The strategy's buffer options pass through and beat the module's hook.
    _, model = _fit(
        BucketDDP(buffer_sync={"seen": "max"}, default_buffer_policy="none"),
        Counting,
        max_steps=2,
        limit_val_batches=0,
    )
    result["strategy_policies"] = weights(model)

    # 8. An unused parameter: the engine's error reaches the user intact, on every rank.
    try:
        _fit(BucketDDP(), Unused, max_steps=2, limit_val_batches=0)
        result["unused_error"] = None
    except RuntimeError as err:
        result["unused_error"] = str(err)

    # 9. A NaN gradient on rank 1 with BucketDDP(check_finite=True): named on every rank.
    try:
        _fit(BucketDDP(check_finite=True), NanOnRank1, max_steps=4, limit_val_batches=0)
        result["nonfinite_error"] = None
    except RuntimeError as err:
        result["nonfinite_error"] = str(err)
    # 10. CommMonitor logs the communication figures through a CSVLogger, every 2 steps.
    logger = CSVLogger(out / "csv", name="comm", version=0)
    monitor = bucketddp.CommMonitor(every_n_steps=2)
    _fit(
        BucketDDP(bucket_cap_mb=0.002, first_bucket_mb=0.0005),
        Boring,
        max_steps=7,
        limit_val_batches=0,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[monitor],
    )
    if trainer.global_rank == 0:
        with open(Path(logger.log_dir) / "metrics.csv") as f:
            result["comm_csv"] = list(csv.DictReader(f))
        result["comm_hparams"] = (Path(logger.log_dir) / "hparams.yaml").read_text()

    result["rank"] = trainer.global_rank
    return result


# -------------------------------------------------------------------- other world sizes
def resume_elsewhere(out: Path, checkpoint: str) -> dict[str, Any]:
    """Resume a world-size-2 step-4 checkpoint to step 8 on SCENARIO_DEVICES processes
    (default 1), and again from a copy whose bucket order names other parameters."""
    devices = int(os.environ.get("SCENARIO_DEVICES", "1"))
    result: dict[str, Any] = {}
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.DEBUG)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(Keep())

    for label, path in (("same_params", checkpoint), ("other_params", _tampered(out, checkpoint))):
        observe = Observe()
        pl.seed_everything(0, verbose=False)
        model = Counting()
        trainer = pl.Trainer(
            **QUIET,
            devices=devices,
            strategy=BucketDDP(),
            max_steps=8,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[observe],
        )
        trainer.fit(model, ckpt_path=path)
        result[label] = {
            "order": observe.seen["train_start"]["bucket_order"],
            "global_step": trainer.global_step,
            "seen": int(model.seen),
            "weights": weights(model),
        }
    result["log"] = records
    # The ground truth at this world size: "ddp" resumed from the same file.
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(**QUIET, devices=devices, strategy="ddp", max_steps=8, limit_val_batches=0)
    trainer.fit(model := Counting(policies=False), ckpt_path=checkpoint)
    result["ddp"] = weights(model)
    # A checkpoint of this world size at an epoch boundary, for tests/lightning/test_resume.py.
    saving = ModelCheckpoint(dirpath=out, every_n_train_steps=8, filename=f"ws{devices}")
    _fit(
        BucketDDP(),
        Counting,
        devices=devices,
        max_steps=8,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[saving],
    )
    result["world_size"] = trainer.world_size
    return result


def cuda(out: Path) -> dict[str, Any]:
    """On one GPU: the same runs under strategy="ddp" and BucketDDP (world size 1, NCCL)."""
    result: dict[str, Any] = {}
    fit = functools.partial(_fit, accelerator="cuda", devices=1, limit_val_batches=0)
    runs: list[tuple[str, Callable[[], pl.LightningModule], dict[str, Any]]] = [
        ("boring", Boring, {"max_steps": 6}),
        ("boring_bf16", Boring, {"max_steps": 4, "precision": "bf16-mixed"}),
        ("transformer_acc2", Transformer, {"max_steps": 2, "accumulate_grad_batches": 2}),
        ("normed", Normed, {"max_steps": 4, "sync_batchnorm": True}),
    ]
    for name, make, kwargs in runs:
        pl.seed_everything(0, verbose=False)
        result[f"{name}/init"] = weights(make())
        for label, strategy in (("ddp", "ddp"), ("bucket", BucketDDP())):
            trainer, model = fit(strategy, make, **kwargs)
            result[f"{name}/{label}"] = weights(model)
            # The strategy's own choice: the process group may be the earlier run's.
            result[f"{name}/{label}/backend"] = trainer.strategy.process_group_backend
    return result


def _tampered(out: Path, checkpoint: str) -> str:
    path = out / f"tampered.rank{os.environ.get('LOCAL_RANK', '0')}.ckpt"
    ckpt = torch.load(checkpoint, weights_only=False)
    ckpt["bucketddp"]["bucket_order"] = ckpt["bucketddp"]["bucket_order"][1:]
    torch.save(ckpt, path)
    return str(path)


# ----------------------------------------------------------------------------- spawn
def spawn(out: Path) -> dict[str, Any]:
    """Fit through "bucket_ddp_spawn"; the main process gets rank 0's weights back.

    This is the swap scenario's "boring" run, so the test compares the weights with its
    strategy="ddp" ones.
    """
    trainer, model = _fit("bucket_ddp_spawn", Boring, max_steps=6, limit_val_batches=0)
    return {"bucket": weights(model), "bucket/strategy": type(trainer.strategy).__name__}


# --------------------------------------------------------------------------- torchrun
def torchrun(out: Path) -> dict[str, Any]:
    """One process per "node", started by torchrun; Lightning's TorchElastic environment."""
    observe = Observe()
    trainer, model = _fit(
        BucketDDP(),
        Counting,
        devices=1,
        num_nodes=2,
        max_steps=4,
        limit_val_batches=0,
        callbacks=[observe],
    )
    return {
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "world_size": trainer.world_size,
        "node_rank": trainer.node_rank,
        "seen": int(model.seen),
        "state": observe.seen["train_start"]["state"],
        "weights": weights(model),
        "rank": trainer.global_rank,
    }


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "swap": swap,
    "lifecycle": lifecycle,
    "resume_elsewhere": resume_elsewhere,
    "spawn": spawn,
    "finetune_single": finetune_single,
    "torchrun": torchrun,
    "cuda": cuda,
}


def main() -> None:
    name, out, *extra = sys.argv[1:]
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = SCENARIOS[name](out_dir, *extra)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    where = "main" if name == "spawn" else f"rank{rank}"
    torch.save(result, out_dir / f"{name}.{where}.pt")
    assert bucketddp.__version__


if __name__ == "__main__":
    main()
