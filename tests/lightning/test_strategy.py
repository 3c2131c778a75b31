"""BucketDDP under Lightning, on real multi-process runs.

Each multi-process check runs a scenario of tests/support/lightning_scenarios.py as a script,
so that Lightning's own launchers (subprocess, spawn, torchrun) start the ranks just as they
do for a user's training script. A scenario runs several Trainers in the same processes and every
rank saves what it saw; the tests below read those results. The ground truth is Lightning's
own ``strategy="ddp"`` on the same seed, and, for resume, the run that never stopped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.version import Version

from lightning_runs import ROOT, SCENARIOS, assert_same, moved, run_script, scenario
from multirank import free_port

lightning = pytest.importorskip("lightning")

ADDED_PER_STEP = 3  # lightning_models.ADDED_PER_STEP, without importing Lightning here


# ------------------------------------------------------------------ in-process checks
# Lightning's DDP names, each with the start method and find_unused_parameters it means.
TRAINER_DDP_NAMES = {
    f"{start}{suffix}": (method, unused)
    for start, method in [
        ("ddp", "popen"),
        ("ddp_spawn", "spawn"),
        ("ddp_fork", "fork"),
        ("ddp_notebook", "fork"),
    ]
    for suffix, unused in [
        ("", False),
        ("_find_unused_parameters_true", True),
        ("_find_unused_parameters_false", False),
    ]
}
FABRIC_DDP_NAMES = {
    name: TRAINER_DDP_NAMES[name]
    for name in ["ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_find_unused_parameters_true"]
}


def test_every_ddp_name_has_a_twin_with_its_meaning() -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy as TrainerDDP
    from lightning.pytorch.strategies import StrategyRegistry

    from bucketddp import BucketDDP, BucketFabricDDP

    # The tables above are Lightning's own lists of DDP names, and what they mean.
    assert {n for n in StrategyRegistry if StrategyRegistry[n]["strategy"] is TrainerDDP} == set(
        TRAINER_DDP_NAMES
    )
    assert {n for n in STRATEGY_REGISTRY if STRATEGY_REGISTRY[n]["strategy"] is DDPStrategy} == (
        set(FABRIC_DDP_NAMES)
    )
    for name, (start_method, unused) in TRAINER_DDP_NAMES.items():
        for twin, built in [(name, TrainerDDP), (f"bucket_{name}", BucketDDP)]:
            strategy = Trainer(strategy=twin, accelerator="cpu", devices=2, logger=False).strategy
            assert type(strategy) is built, twin
            assert strategy._start_method == start_method, twin
            assert strategy._ddp_kwargs.get("find_unused_parameters", False) is unused, twin
    for name, (start_method, unused) in FABRIC_DDP_NAMES.items():
        for twin, built in [(name, DDPStrategy), (f"bucket_{name}", BucketFabricDDP)]:
            strategy = Fabric(strategy=twin, accelerator="cpu", devices=2).strategy
            assert type(strategy) is built, twin
            assert strategy._start_method == start_method, twin
            assert strategy._ddp_kwargs.get("find_unused_parameters", False) is unused, twin
    bucket = Fabric(strategy="bucket_ddp_find_unused_parameters_true", devices=2).strategy
    assert bucket.engine_options.find_unused_parameters is True


def test_options_pass_through_and_bad_ones_fail_early() -> None:
    from datetime import timedelta

    from bucketddp import BucketDDP

    s = BucketDDP(
        bucket_cap_mb=4,
        first_bucket_mb=0.5,
        gradient_as_bucket_view=False,
        buffer_sync={"*.running_*": "mean"},
        default_buffer_policy="none",
        static_graph=True,
        process_group_backend="gloo",
        timeout=timedelta(seconds=30),
    )
    assert s._ddp_kwargs == {
        "bucket_cap_mb": 4,
        "first_bucket_mb": 0.5,
        "find_unused_parameters": False,
        "gradient_as_bucket_view": False,
        "broadcast_buffers": None,
        "buffer_sync": {"*.running_*": "mean"},
        "default_buffer_policy": "none",
        "static_graph": True,
        "init_sync": True,
        "forward_sync_buffers": None,
        "check_finite": False,
        "telemetry": True,
        "watchdog": True,
        "stall_timeout": 600.0,
    }
    assert s.process_group_backend == "gloo"
    assert s._timeout == timedelta(seconds=30)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive, finite number"):
        BucketDDP(bucket_cap_mb=0)
    assert BucketDDP(bucket_cap_mb=None)._ddp_kwargs["bucket_cap_mb"] == 25.0  # torch DDP's
    with pytest.raises(ValueError, match="unknown buffer policy 'avg'"):
        BucketDDP(default_buffer_policy="avg")
    with pytest.raises(TypeError, match="sync_batchnorm must be True or False, got str 'yes'"):
        BucketDDP(sync_batchnorm="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="find_unused_parameters must be True or False"):
        BucketDDP(find_unused_parameters="False")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"buffer_sync is a list \(\['a'\]\); use a dict"):
        BucketDDP(buffer_sync=["a"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="broadcast_buffers=True contradicts forward_sync_"):
        BucketDDP(broadcast_buffers=True, forward_sync_buffers=False)
    with pytest.raises(ValueError, match="forward_sync_buffers=False contradicts default_buf"):
        BucketDDP(forward_sync_buffers=False, default_buffer_policy="mean")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook

    with pytest.raises(ValueError, match="ddp_comm_wrapper apply to a ddp_comm_hook"):
        BucketDDP(ddp_comm_wrapper=default_hooks.fp16_compress_wrapper)
    local_sgd = post_localSGD_hook.PostLocalSGDState(None, None, start_localSGD_iter=8)
    hook = post_localSGD_hook.post_localSGD_hook
    with pytest.raises(ValueError, match="pass model_averaging_period=N"):
        BucketDDP(ddp_comm_state=local_sgd, ddp_comm_hook=hook)
    with pytest.raises(ValueError, match="applies to post-local SGD only"):
        BucketDDP(model_averaging_period=4)
    with pytest.raises(ValueError, match="must be a positive integer, got 0"):
        BucketDDP(ddp_comm_state=local_sgd, ddp_comm_hook=hook, model_averaging_period=0)
    hooked = BucketDDP(
        ddp_comm_hook=default_hooks.allreduce_hook,
        ddp_comm_wrapper=default_hooks.fp16_compress_wrapper,
    )
    assert hooked._comm_hook is not None and hooked._comm_hook[0] is None


def test_sync_batchnorm_uses_our_layer_sync_plugin() -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins import LayerSync

    from bucketddp import BucketDDP
    from bucketddp.lightning.layer_sync import BucketSyncBatchNorm

    def layer_sync(**kwargs: Any) -> object:
        trainer = Trainer(accelerator="cpu", devices=2, logger=False, **kwargs)
        return trainer.strategy._layer_sync

    assert layer_sync(strategy=BucketDDP()) is None
    assert isinstance(layer_sync(strategy=BucketDDP(sync_batchnorm=True)), BucketSyncBatchNorm)
    # Lightning's TorchSyncBatchNorm, from the Trainer's flag or given explicitly, reaches
    # the strategy alike: it is replaced by ours, with a warning that says why...
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    why = "torch.nn.SyncBatchNorm refuses CPU tensors in training"
    for kwargs in [{"sync_batchnorm": True}, {"plugins": [TorchSyncBatchNorm()]}]:
        with pytest.warns(UserWarning, match=why):
            assert isinstance(layer_sync(strategy=BucketDDP(), **kwargs), BucketSyncBatchNorm)
    # ...unless the strategy was asked for SyncBatchNorm itself.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin = layer_sync(strategy=BucketDDP(sync_batchnorm=True), sync_batchnorm=True)
    assert isinstance(plugin, BucketSyncBatchNorm)

    class Mine(LayerSync):
        def apply(self, model: torch.nn.Module) -> torch.nn.Module:
            return model

        def revert(self, model: torch.nn.Module) -> torch.nn.Module:
            return model

    assert isinstance(layer_sync(strategy=BucketDDP(), plugins=[Mine()]), Mine)


IMPORT_CHECKS = {
    "bucketddp first": """
        import sys, bucketddp
        assert not [m for m in sys.modules if m.startswith("lightning")]
        from lightning.pytorch import Trainer
        from lightning.pytorch.strategies import StrategyRegistry
        assert {"bucket_ddp", "bucket_ddp_spawn",
                "bucket_ddp_find_unused_parameters_true"} <= set(StrategyRegistry)
        assert type(Trainer(strategy="bucket_ddp", logger=False).strategy) is bucketddp.BucketDDP
        from lightning.fabric import Fabric
        fabric = Fabric(strategy="bucket_ddp_notebook", accelerator="cpu", devices=2)
        assert type(fabric.strategy) is bucketddp.BucketFabricDDP
        # The import hook leaves Lightning's own loader in place, and removes itself.
        import lightning.pytorch as lp
        assert "Registering" not in type(lp.__loader__).__name__
        assert not [f for f in sys.meta_path if "Lightning" in type(f).__name__]
    """,
    "lightning first": """
        import lightning
        import bucketddp
        from lightning.pytorch.strategies import StrategyRegistry
        assert "bucket_ddp_spawn" in StrategyRegistry
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        assert "bucket_ddp_fork" in STRATEGY_REGISTRY
    """,
    "bucketddp.lightning.fabric first": """
        import sys
        from bucketddp.lightning.fabric import BucketFabricDDP
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        from lightning.pytorch.strategies import StrategyRegistry
        assert STRATEGY_REGISTRY["bucket_ddp"]["strategy"] is BucketFabricDDP
        assert "bucket_ddp_notebook" in StrategyRegistry
        assert not [f for f in sys.meta_path if "Lightning" in type(f).__name__]
    """,
    "without lightning": """
        import sys
        sys.modules["lightning"] = None  # as if Lightning were not installed
        import torch, bucketddp
        assert bucketddp.BucketDataParallel and bucketddp.convert_sync_batchnorm
        for name in ("BucketDDP", "BucketFabricDDP"):
            try:
                getattr(bucketddp, name)
            except ImportError as err:
                assert "pip install" in str(err), err
            else:
                raise AssertionError(f"{name} without Lightning should raise ImportError")
    """,
}


def test_sync_batchnorm_without_a_batchnorm_layer_warns() -> None:
    import warnings

    from lightning.pytorch.demos.boring_classes import BoringModel

    from bucketddp import BucketDDP

    # What DDPStrategy.setup does with the plugin: ours warns when it finds nothing to convert.
    plugin = BucketDDP(sync_batchnorm=True)._layer_sync
    assert plugin is not None
    with pytest.warns(UserWarning, match=r"sync_batchnorm=True, but the model \(BoringModel\) has"):
        plugin.apply(BoringModel())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin.apply(torch.nn.Sequential(torch.nn.BatchNorm1d(2)))


@pytest.mark.parametrize("order", list(IMPORT_CHECKS))
def test_import_order(order: str) -> None:
    run_script([sys.executable, "-c", textwrap.dedent(IMPORT_CHECKS[order])], timeout=120)


# ------------------------------------------------------------- swap-in against "ddp"
@pytest.fixture(scope="module")
def swap(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return scenario("swap", tmp_path_factory.mktemp("swap"))


@pytest.mark.compat("fit")
@pytest.mark.parametrize(
    "run", ["boring", "boring_acc2", "boring_bf16", "transformer", "transformer_acc2"]
)
def test_swap_in_gives_the_weights_of_ddp(swap: list[dict[str, Any]], run: str) -> None:
    for rank in swap:
        assert moved(rank[f"{run}/init"], rank[f"{run}/ddp"]), "the run did not train"
        assert_same(rank[f"{run}/ddp"], rank[f"{run}/bucket"], tol=1e-6)


def test_gradient_clipping_sees_reduced_gradients(swap: list[dict[str, Any]]) -> None:
    # Clipping at 0.05 acts on every step; the norms it saw agree across ranks (reduced)
    # and with Lightning's DDP, and so do the weights.
    r0, r1 = swap
    assert r0["clip_norms/bucket"] == r1["clip_norms/bucket"]
    assert r0["clip_norms/bucket"] == pytest.approx(r0["clip_norms/ddp"], rel=1e-6)
    assert min(r0["clip_norms/bucket"]) > 0.05
    assert_same(r0["clip/ddp"], r0["clip/bucket"], tol=1e-6)


def test_accumulation_communicates_once_per_k_batches(swap: list[dict[str, Any]]) -> None:
    for rank in swap:
        buckets = rank["buckets/acc1"]
        assert buckets >= 2
        # Eight batches either way: eight synced steps, or four.
        assert rank["allreduces/acc1"] == 8 * buckets
        assert rank["allreduces/acc2"] == 4 * buckets
        assert rank["synced/acc1"] == list(range(8))
        assert rank["synced/acc2"] == [1, 3, 5, 7]


def test_manual_optimization_with_toggle_model(swap: list[dict[str, Any]]) -> None:
    for rank in swap:
        assert_same(rank["gan/ddp"], rank["gan/bucket"], tol=1e-6)
        assert_same(rank["gan/ddp"], rank["gan/bucket_default"], tol=1e-6)
        # toggle_model(sync_grad=False) on even batches: only odd batches communicate.
        assert rank["gan_synced/bucket"] == [1, 3, 1, 3]
        assert rank["gan_synced/bucket_default"] == [1, 3, 1, 3]


def test_manual_optimization_syncs_buffers_before_every_step(
    swap: list[dict[str, Any]],
) -> None:
    r0, r1 = swap
    for rank in swap:
        # BatchNorm trains on batch statistics, so the weights are those of "ddp"...
        assert_same(rank["manual_bn/ddp"], rank["manual_bn/bucket"], 1e-6, ("running",))
    # ...but the running statistics each step starts from agree across ranks only under
    # BucketDDP. Under "ddp" they drift apart after the first step.
    for a, b in zip(r0["manual_bn_seen/bucket"], r1["manual_bn_seen/bucket"], strict=True):
        assert torch.equal(a, b)
    seen_ddp = zip(r0["manual_bn_seen/ddp"], r1["manual_bn_seen/ddp"], strict=True)
    assert [torch.equal(a, b) for a, b in seen_ddp] == [True] + [False] * 5


def test_static_graph_reaches_the_wrapper_and_trains_as_ddp(swap: list[dict[str, Any]]) -> None:
    for rank in swap:
        assert rank["static_flag/bucket"] is True
        assert moved(rank["boring/init"], rank["static/bucket"])
        assert_same(rank["static/ddp"], rank["static/bucket"], tol=1e-6)


def test_post_local_sgd_gives_the_weights_of_ddp(swap: list[dict[str, Any]]) -> None:
    for rank in swap:
        assert_same(rank["local_sgd/ddp"], rank["local_sgd/bucket"], tol=1e-6)
        # Local steps made it differ from fully synced training (the "boring" run).
        assert moved(rank["boring/bucket"], rank["local_sgd/bucket"])
    # Step 6 averaged the parameters, so the ranks agree again.
    assert_same(swap[0]["local_sgd/bucket"], swap[1]["local_sgd/bucket"], tol=1e-6)


def test_ignored_parameters_stay_rank_local_as_with_ddp(swap: list[dict[str, Any]]) -> None:
    for rank in swap:
        assert moved(rank["boring/init"], rank["ignored/bucket"])
        assert_same(rank["ignored/ddp"], rank["ignored/bucket"], tol=1e-6)
    # layer.bias started apart (setup adds the rank) and no rank's value reached the other.
    r0, r1 = (rank["ignored/bucket"] for rank in swap)
    assert not torch.allclose(r0["layer.bias"], r1["layer.bias"], atol=0.5)
    assert torch.equal(r0["layer.weight"], r1["layer.weight"])


def test_compiled_model_gives_the_weights_of_ddp(swap: list[dict[str, Any]]) -> None:
    for rank in swap:
        assert rank["compiled_graphs/bucket"] >= 1, "Lightning did not compile the model"
        assert moved(rank["boring/init"], rank["compiled/bucket"])
        assert_same(rank["compiled/ddp"], rank["compiled/bucket"], tol=1e-6)


def test_communication_hook_gives_the_weights_of_ddp_with_it(swap: list[dict[str, Any]]) -> None:
    for rank in swap:
        # fp16 compression under "ddp" (registered by a callback: Lightning registers
        # ddp_comm_hook only on CUDA) and under BucketDDP(ddp_comm_hook=...) agree...
        assert_same(rank["fp16/ddp"], rank["fp16/bucket"], tol=1e-6)
        # ...and differ from the uncompressed run, so the hook was used.
        assert moved(rank["boring/ddp"], rank["fp16/bucket"])


def test_backbone_finetuning_matches_one_process(
    swap: list[dict[str, Any]], tmp_path: Path
) -> None:
    (truth,) = scenario("finetune_single", tmp_path)
    for rank in swap:
        # The backbone, frozen when the model was wrapped, trained from epoch 1 on.
        assert moved(
            {"w": rank["finetune/init"]["backbone.0.weight"]},
            {"w": rank["finetune/bucket"]["backbone.0.weight"]},
        )
        assert_same(rank["finetune/bucket"], truth["single"], tol=1e-6)
    # Lightning's DDP never reduces the unfrozen backbone: its ranks drift apart.
    r0, r1 = swap
    assert not torch.equal(
        r0["finetune/ddp"]["backbone.0.weight"], r1["finetune/ddp"]["backbone.0.weight"]
    )


# ------------------------------------------------------------- fit, checkpoint, resume
# The lifecycle fixture (one launch of the "lifecycle" scenario) is in conftest.py.


def test_comm_monitor_logs_consistent_figures_through_the_csv_logger(
    lifecycle: tuple[Path, list[dict[str, Any]]],
) -> None:
    r0 = lifecycle[1][0]
    # Lightning writes a value logged in a step on the step's row and the next one's too.
    logged = {
        tuple(sorted((k, v) for k, v in r.items() if k.startswith("comm/"))) for r in r0["comm_csv"]
    }
    rows = [dict(r) for r in logged if dict(r).get("comm/total_ms")]
    assert len(rows) == 3  # steps 2-3, 4-5 and 6-7: the first step only starts the clock
    planned = int(re.search(r"gradient_bytes: (\d+)", r0["comm_hparams"]).group(1))
    assert "bucketddp/plan:" in r0["comm_hparams"]
    for row in rows:
        f = {k: float(v) for k, v in row.items() if k.startswith("comm/") and v}
        assert 0 <= f["comm/exposed_wait_ms"] <= f["comm/total_ms"] + 2.0
        assert f["comm/total_ms"] <= f["comm/step_ms"]
        assert 0 <= f["comm/hidden_ms"] <= f["comm/total_ms"]
        assert f["comm/buckets"] == 1  # BoringModel: one layer
        # The plan's gradients, and the agreement row that rides on the last bucket.
        assert planned <= f["comm/bytes"] <= planned + 4096
        assert f["comm/bytes_per_s"] > 0


def test_fit_wraps_and_teardown_unwraps(lifecycle: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = lifecycle
    for r in ranks:
        seen = r["observed"]
        assert seen["setup_wrapper"] == "Counting"  # LightningModule.setup: not wrapped yet
        assert seen["train_start"]["wrapper"] == "BucketDataParallel"
        assert seen["fit_validation"]["wrapper"] == "BucketDataParallel"
        # Outside of fit no reducer is attached, as with DDPStrategy.
        for stage in ("validate", "test", "predict"):
            assert seen[stage]["wrapper"] == "Counting", stage
        assert r["after_fit"]["is_plain"]
        assert r["after_fit"]["hooks"] == 0
        assert r["after_fit"]["watchdogs"] == 0  # it ended with the strategy's teardown
        assert r["eval_hooks"] == 0


def test_ranks_agree_in_validation_test_and_predict(
    lifecycle: tuple[Path, list[dict[str, Any]]],
) -> None:
    r0, r1 = lifecycle[1]
    for stage in ("fit_validation", "validate", "test", "predict"):
        assert torch.equal(r0["observed"][stage]["state"], r1["observed"][stage]["state"]), stage


def test_sync_dist_logs_and_torchmetrics_are_global(
    lifecycle: tuple[Path, list[dict[str, Any]]],
) -> None:
    # Two validation batches per rank, each logging rank + 1: a global sum of 2*1 + 2*2.
    for r in lifecycle[1]:
        assert r["after_fit"]["metrics"] == {"val_rank_sum": 6.0, "val_total": 6.0}
        assert r["validate"] == [{"val_rank_sum": 6.0, "val_total": 6.0}]
        assert r["test"] == [{"val_rank_sum": 6.0, "val_total": 6.0}]


def test_checkpoint_is_written_by_rank0_without_wrapper_prefixes(
    lifecycle: tuple[Path, list[dict[str, Any]]],
) -> None:
    from lightning_models import Counting

    out, ranks = lifecycle
    assert (out / "writers.txt").read_text().split() == ["0", "0"]  # steps 4 and 8
    ckpt = torch.load(out / "checkpoints" / "step=4.ckpt", weights_only=False)
    assert not [k for k in ckpt["state_dict"] if k.startswith("module.")]
    # The learned order travels with the checkpoint.
    order = ranks[0]["observed"]["fit_validation"]["bucket_order"]
    assert order and ckpt["bucketddp"] == {"bucket_order": order}
    # Buffers were synced before saving: the "sum" counter holds the global total, the
    # "none" buffer is rank 0's copy.
    assert int(ckpt["state_dict"]["seen"]) == 2 * ADDED_PER_STEP * 4
    assert float(ckpt["state_dict"]["local_mark"]) == 1.0
    # It loads into a plain LightningModule, strictly.
    plain = Counting.load_from_checkpoint(out / "checkpoints" / "step=4.ckpt")
    assert_same(plain.state_dict(), ckpt["state_dict"])


@pytest.mark.skipif(
    Version(lightning.__version__) < Version("2.5"),
    reason="Lightning 2.4 resumes every_n_train_steps checkpoints inexactly, for 'ddp' too",
)
def test_resume_is_exact(lifecycle: tuple[Path, list[dict[str, Any]]]) -> None:
    for r in lifecycle[1]:
        assert_same(r["straight"], r["checkpointed"])  # checkpointing changes nothing
        assert_same(r["straight"], r["resumed"])  # stop at 4 + resume == 8 straight
        straight, resumed = r["straight_optimizer"]["state"], r["resumed_optimizer"]["state"]
        assert straight.keys() == resumed.keys()
        for i in straight:
            for key in straight[i]:
                assert torch.equal(straight[i][key], resumed[i][key]), (i, key)
        # The resumed run adopted the saved bucket order before its first backward.
        saved = r["observed"]["fit_validation"]["bucket_order"]
        assert r["resume_observed"]["train_start"]["bucket_order"] == saved


def test_checkpoint_resumes_under_torch_ddp(lifecycle: tuple[Path, list[dict[str, Any]]]) -> None:
    r0 = lifecycle[1][0]
    # Resuming under strategy="ddp" trains on exactly as resuming under BucketDDP. torch
    # DDP broadcasts every buffer, so only the policy-driven buffers may differ.
    assert_same(r0["resumed"], r0["resumed_torch_ddp"], tol=1e-6, skip=("seen", "local_"))


def test_buffer_policies_from_the_module_hook(lifecycle: tuple[Path, list[dict[str, Any]]]) -> None:
    for rank, r in enumerate(lifecycle[1]):
        for run in ("straight", "resumed"):
            # "sum": world * k * steps on every rank, across the resume too.
            assert int(r[run]["seen"]) == 2 * ADDED_PER_STEP * 8
            # "none": each rank keeps its own.
            assert float(r[run]["local_mark"]) == rank + 1


def test_strategy_buffer_options_beat_the_module_hook(
    lifecycle: tuple[Path, list[dict[str, Any]]],
) -> None:
    # BucketDDP(buffer_sync={"seen": "max"}, default_buffer_policy="none") for two steps.
    r0, r1 = (r["strategy_policies"] for r in lifecycle[1])
    assert int(r0["seen"]) == int(r1["seen"]) == ADDED_PER_STEP * 2  # "max", not "sum"
    # BatchNorm statistics under "none" stay each rank's own.
    assert not torch.equal(r0["net.1.running_mean"], r1["net.1.running_mean"])


def test_sync_batchnorm_on_cpu(lifecycle: tuple[Path, list[dict[str, Any]]]) -> None:
    r0, r1 = lifecycle[1]
    for label in ("trainer_flag", "strategy_flag"):
        for r in (r0, r1):
            assert r[f"syncbn/{label}"]["during"] == ["SyncBatchNorm"]
            assert r[f"syncbn/{label}"]["after"] == ["BatchNorm1d"]
            assert r[f"syncbn/{label}"]["predict"] == ["BatchNorm1d"]
        # Global statistics: the running stats agree without any buffer sync.
        assert_same(r0[f"syncbn/{label}"]["state"], r1[f"syncbn/{label}"]["state"])
    assert_same(r0["syncbn/trainer_flag"]["state"], r0["syncbn/strategy_flag"]["state"])


def test_zero_redundancy_optimizer_and_checkpoint_after_fit(
    lifecycle: tuple[Path, list[dict[str, Any]]],
) -> None:
    from lightning_models import Zero

    r0, r1 = lifecycle[1]
    assert_same(r0["zero"]["weights"], r1["zero"]["weights"], skip=("local_",))
    ckpt = torch.load(r0["zero"]["path"], weights_only=False)
    assert ckpt["bucketddp"]["bucket_order"]  # the order of the finished fit
    loaded = Zero.load_from_checkpoint(r0["zero"]["path"])
    assert_same(weights_of(loaded), r0["zero"]["weights"])


def weights_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def test_unused_parameter_error_reaches_the_user(
    lifecycle: tuple[Path, list[dict[str, Any]]],
) -> None:
    for r in lifecycle[1]:
        message = r["unused_error"]
        assert message is not None
        assert "['idle.weight', 'idle.bias']" in message
        assert "Pass BucketDDP(find_unused_parameters=True), or " in message
        assert 'Trainer(strategy="bucket_ddp_find_unused_parameters_true")' in message


def test_nan_gradient_on_rank1_is_named_on_every_rank_with_check_finite(
    lifecycle: tuple[Path, list[dict[str, Any]]],
) -> None:
    for r in lifecycle[1]:
        message = r["nonfinite_error"]
        assert message is not None
        assert "on rank 1 in ['net.3.weight'] (check_finite=True)" in message


# ----------------------------------------------------------------- other launchers
def test_spawn_launcher(swap: list[dict[str, Any]], tmp_path: Path) -> None:
    run_script([sys.executable, str(SCENARIOS), "spawn", str(tmp_path)], timeout=240)
    result = torch.load(tmp_path / "spawn.main.pt", weights_only=False)
    assert result["bucket/strategy"] == "BucketDDP"
    # The main process holds rank 0's weights: those of the same run under "ddp".
    assert_same(result["bucket"], swap[0]["boring/ddp"], tol=1e-6)


def test_torchrun_two_nodes_on_loopback(tmp_path: Path) -> None:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                str(SCENARIOS),
                "torchrun",
                str(tmp_path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=180)
            outputs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-6000:]
        assert "terminate called" not in out
    r0, r1 = (torch.load(tmp_path / f"torchrun.rank{i}.pt", weights_only=False) for i in (0, 1))
    for node, r in enumerate((r0, r1)):
        assert r["environment"] == "TorchElasticEnvironment"
        assert (r["world_size"], r["node_rank"], r["rank"]) == (2, node, node)
        assert r["seen"] == 2 * ADDED_PER_STEP * 4
    assert torch.equal(r0["state"], r1["state"])
    assert_same(r0["weights"], r1["weights"], skip=("local_",))


def test_runs_exit_cleanly() -> None:
    # The 30-run version of this check: python benchmarks/lightning_exit_status.py --runs 30
    script = ROOT / "benchmarks" / "lightning_exit_status.py"
    out = run_script([sys.executable, str(script), "--runs", "2"], timeout=240)
    assert "bucket_ddp: 0 of 2 runs ended abnormally" in out
