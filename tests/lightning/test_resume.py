"""Resuming BucketDDP from a checkpoint only rank 0 can read, and resume exactness.

Each rank runs in a working directory of its own (tests/support/resume_scenarios.py), as on
nodes with local disks only, and ``ckpt_path`` is relative: the file exists in rank 0's
directory alone. The ground truth is the run that never stopped (bit for bit), and
Lightning's ``"ddp"`` resumed from copies of the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_runs import SUPPORT, assert_same, run_nodes

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

SCRIPT = SUPPORT / "resume_scenarios.py"
ADDED_PER_STEP = 3  # lightning_models.ADDED_PER_STEP, without importing Lightning here
POLICY_BUFFERS = ("seen", "local_")  # "sum" and "none" buffers: "ddp" has no such policies


def _assert_like_ddp(
    ours: dict[str, Any], ddp: dict[str, Any], rank: int, tol: float = 1e-6, skip: Any = ()
) -> None:
    """Weights as "ddp"'s. After fit BucketDDP syncs buffers from rank 0 once more; "ddp"
    leaves each rank the BatchNorm statistics of its last batch."""
    skip = (*POLICY_BUFFERS, *skip, *(("running_",) if rank else ()))
    assert_same(ours, ddp, tol, skip)


@pytest.fixture(scope="module")
def resumed(
    tmp_path_factory: pytest.TempPathFactory, at_world_size_1: tuple[Path, dict[str, Any]]
) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("resume")
    ws1 = str(at_world_size_1[0] / "ws1.ckpt")
    return out, run_nodes(SCRIPT, "resume", out, 2, ws1)


def _assert_exact(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit for bit: weights, buffers and the optimizer's state."""
    assert_same(got["weights"], want["weights"])
    assert got["optimizer"].keys() == want["optimizer"].keys()
    for i, state in want["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer"][i][key], value), (i, key)


def test_rank0_only_checkpoint_resumes_exactly(resumed: tuple[Path, list[dict[str, Any]]]) -> None:
    out, ranks = resumed
    assert not (out / "node1" / "checkpoints").exists()  # rank 1 has no copy ...
    saved = torch.load(out / "node0/checkpoints/stateful/step=2.ckpt", weights_only=False)
    for rank, r in enumerate(ranks):
        for label in ("stateful_mid", "plain_boundary", "from_ddp", "from_ws1"):
            assert r[label]["opened"] == [], label  # ... and never opened rank 0's
            assert r[label]["global_step"] == (12 if label == "from_ws1" else 8)
        # Mid-epoch with a stateful loader: what never stopped, bit for bit.
        run = r["stateful_mid"]
        _assert_exact(run, r["straight/stateful"])
        # Everything came through: loops and loader (above), the bucket order, the
        # callback's state, the module's own extras.
        assert run["order"] == saved["bucketddp"]["bucket_order"]
        assert run["tally"] == {"batches": 2}
        assert run["extras"]["note"] == "mine"
        assert torch.equal(run["extras"]["tensor"], torch.full((3,), 2))
        # "sum": world * k * steps on every rank across the resume; "none": each its own.
        assert int(run["weights"]["seen"]) == 2 * ADDED_PER_STEP * 8
        assert float(run["weights"]["local_mark"]) == rank + 1
        # At the epoch boundary a plain DataLoader resumes exactly too.
        _assert_exact(r["plain_boundary"], r["straight/plain"])
        # The straight runs see the same batches whichever the loader.
        _assert_exact(r["straight/plain"], r["straight/stateful"])
        # "ddp" from copies of the same files trains on to the same weights.
        for label in ("stateful_mid", "stateful_boundary", "plain_boundary", "plain_mid"):
            _assert_like_ddp(r[label]["weights"], r[f"{label}/ddp"]["weights"], rank)


def test_missing_on_rank0_fails_on_every_rank(
    resumed: tuple[Path, list[dict[str, Any]]],
) -> None:
    out = resumed[0]
    for r in resumed[1]:
        assert "'checkpoints/missing.ckpt' not found on rank 0" in r["missing"]
        assert str(out / "node0" / "checkpoints" / "missing.ckpt") in r["missing"]


def test_where_resuming_is_not_exact(resumed: tuple[Path, list[dict[str, Any]]]) -> None:
    # Two cases docs/strategy.md warns of, under "ddp" alike (compared in the test above):
    # - mid-epoch with a plain DataLoader, which has no state: Lightning starts its epoch
    #   over, so the batches before the checkpoint are seen again;
    # - with a stateful loader, a checkpoint every_n_train_steps took on an epoch's last
    #   batch: the resumed run does not see the next epoch's batches as the straight run did.
    for r in resumed[1]:
        for label, straight in (("plain_mid", "plain"), ("stateful_boundary", "stateful")):
            assert r[label]["opened"] == []
            again, want = r[label]["weights"], r[f"straight/{straight}"]["weights"]
            assert not torch.equal(want["net.0.weight"], again["net.0.weight"]), label


def test_ddp_checkpoint_with_module_prefix_resumes(
    resumed: tuple[Path, list[dict[str, Any]]],
) -> None:
    # Four steps under "ddp", the file's keys renamed "module.*", four more under BucketDDP.
    out, ranks = resumed
    ckpt = torch.load(out / "node0/checkpoints/ddp_prefixed.ckpt", weights_only=False)
    assert all(k.startswith("module.") for k in ckpt["state_dict"])
    for rank, r in enumerate(ranks):
        _assert_like_ddp(r["from_ddp"]["weights"], r["straight/plain"]["weights"], rank)


def test_validate_test_predict_from_rank0_only_checkpoint(
    resumed: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, ranks = resumed
    saved = torch.load(out / "node0/checkpoints/stateful/step=8.ckpt", weights_only=False)
    for r in ranks:
        for stage, run in r["evaluated"].items():
            assert run["opened"] == [], stage
            assert_same(run["weights"], saved["state_dict"], skip=("local_",))


def test_resume_at_world_size_1(
    lifecycle: tuple[Path, list[dict[str, Any]]], at_world_size_1: tuple[Path, dict[str, Any]]
) -> None:
    _, r = at_world_size_1
    assert r["world_size"] == 1
    saved = lifecycle[1][0]["observed"]["fit_validation"]["bucket_order"]
    same, other = r["same_params"], r["other_params"]
    assert same["order"] == saved
    assert other["order"] is None  # learned again in the first backward
    assert any("learned again" in line for line in r["log"])
    for run in (same, other):
        assert run["global_step"] == 8
        # 4 steps at world size 2, then 4 at world size 1, each rank adding k per step.
        assert run["seen"] == 2 * ADDED_PER_STEP * 4 + ADDED_PER_STEP * 4
    assert_same(same["weights"], other["weights"])
    _assert_like_ddp(same["weights"], r["ddp"], 0)  # 2 -> 1, as "ddp"


def test_resume_at_world_size_2_from_1(resumed: tuple[Path, list[dict[str, Any]]]) -> None:
    for rank, r in enumerate(resumed[1]):
        run = r["from_ws1"]
        _assert_like_ddp(run["weights"], r["from_ws1/ddp"]["weights"], rank)
        # 8 steps at world size 1, then 4 at world size 2.
        assert int(run["weights"]["seen"]) == ADDED_PER_STEP * 8 + 2 * ADDED_PER_STEP * 4


def test_resume_at_world_size_3_from_2(
    resumed: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    checkpoint = resumed[0] / "node0/checkpoints/plain/step=4.ckpt"
    ranks = run_nodes(SCRIPT, "at_world_size", tmp_path, 3, str(checkpoint))
    for r in ranks[1:]:
        assert r["bucket"]["opened"] == []
    for rank, r in enumerate(ranks):
        run = r["bucket"]
        assert run["global_step"] == 6
        # Three ranks' gradients sum in another order than under "ddp" (a + b + c rounds by
        # order; a + b does not). That shows only in net.0.bias: BatchNorm follows it, so its
        # gradient is rounding noise, which Adam scales up to whole steps.
        _assert_like_ddp(run["weights"], r["ddp"]["weights"], rank, 1e-5, ("net.0.bias",))
        # 4 steps at world size 2, then 2 at world size 3.
        assert int(run["weights"]["seen"]) == 2 * ADDED_PER_STEP * 4 + 3 * ADDED_PER_STEP * 2
