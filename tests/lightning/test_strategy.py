"""BucketDDP under Lightning, on real multi-process runs (the in-process checks are in
test_strategy_setup.py).

Each multi-process check runs a scenario of tests/support/lightning_scenarios.py as a
script, so that Lightning's own launchers (subprocess, spawn, torchrun) start the ranks just
as they do for a user's training script. A scenario runs several Trainers in the same
processes and every rank saves what it saw; the tests below read those results. The ground
truth is Lightning's own ``strategy="ddp"`` on the same seed, and, for resume, the run that
never stopped. Every run must also end cleanly: ``run_script`` fails a test whose run exits
non-zero or prints "terminate called" on any rank (the 30-run count of that:
``python3 dev.py bench-exits``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.version import Version

from lightning_runs import ROOT, SCENARIOS, assert_same, moved, run_script, scenario
from multirank import free_port

lightning = pytest.importorskip("lightning")

ADDED_PER_STEP = 3  # lightning_models.ADDED_PER_STEP, without importing Lightning here


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
        # One clock, nested intervals: exact however slow the machine, up to rounding (1 us).
        assert 0 <= f["comm/exposed_wait_ms"] <= f["comm/total_ms"] + 1e-3
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


@pytest.mark.jobs  # two torchrun agents
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
