"""Resuming BucketDDP from a checkpoint only rank 0 can read, and resume exactness.

Each rank runs in a working directory of its own (tests/support/resume_scenarios.py), as on
nodes with local disks only, and ``ckpt_path`` is relative: the file exists in rank 0's
directory alone. The ground truth is the run that never stopped (bit for bit), and
Lightning's ``"ddp"`` resumed from copies of the same files. Lightning's DistributedSampler
gives each epoch its own order of the rows; the ``epochs`` scenario resumes in epochs 1 and
2.
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
        # At the epoch boundary a plain DataLoader resumes exactly too, and so does the
        # stateful one (where Lightning would restore it at the end of the finished epoch).
        _assert_exact(r["plain_boundary"], r["straight/plain"])
        _assert_exact(r["stateful_boundary"], r["straight/stateful"])
        # The straight runs see the same batches whichever the loader.
        _assert_exact(r["straight/plain"], r["straight/stateful"])
        # "ddp" from copies of the same files trains on to the same weights (but for the
        # stateful loader at the epoch boundary: see the next test).
        for label in ("stateful_mid", "plain_boundary", "plain_mid"):
            _assert_like_ddp(r[label]["weights"], r[f"{label}/ddp"]["weights"], rank)


def test_missing_on_rank0_fails_on_every_rank(
    resumed: tuple[Path, list[dict[str, Any]]],
) -> None:
    out = resumed[0]
    for r in resumed[1]:
        assert "'checkpoints/missing.ckpt' not found on rank 0" in r["missing"]
        assert str(out / "node0" / "checkpoints" / "missing.ckpt") in r["missing"]


def test_where_resuming_is_not_exact(resumed: tuple[Path, list[dict[str, Any]]]) -> None:
    # What docs/strategy.md warns of:
    # - mid-epoch with a plain DataLoader, which has no state: Lightning starts its epoch
    #   over, so the batches before the checkpoint are seen again (under "ddp" alike);
    # - under "ddp", a stateful loader checkpointed on an epoch's last batch: Lightning
    #   restores it at the end of that epoch, so the next epoch ends at once, without a batch.
    for r in resumed[1]:
        for label, straight in (
            ("plain_mid", "plain"),
            ("stateful_boundary/ddp", "stateful"),
        ):
            assert r[label]["opened"] == []
            again, want = r[label]["weights"], r[f"straight/{straight}"]["weights"]
            assert not torch.equal(want["net.0.weight"], again["net.0.weight"]), label


EXACT = (
    # StatefulDataLoader: mid-epoch in epoch 1 and in epoch 2, and on epoch 1's last batch.
    "stateful@step=6,stateful@step=9,stateful@step=8,"
    # At epoch 1's end (on_train_epoch_end), fitting to max_epochs.
    "stateful@epoch=1/max_epochs,"
    # With a worker process, which draws its first indices as the loader's iterator is made.
    "stateful_workers@step=9,plain_workers@step=4,"
    # A plain DataLoader at the end of epoch 1.
    "plain@step=8"
)
"""The ``epochs`` scenario's resumes BucketDDP makes bit for bit: ``loader@checkpoint``,
4 steps an epoch (see resume_scenarios.LOADERS), to step 12 or ``/max_epochs`` 3."""
EPOCH_CASES = (
    f"{EXACT},"
    # Under "ddp".
    "plain@step=8/ddp,stateful@step=6/ddp,plain_workers@step=4/ddp,"
    # Not exact, under either: at epoch 1's end fitting to max_steps, and
    # StatefulDataLoader(shuffle=True) in epoch 0.
    "plain@epoch=1,plain@epoch=1/ddp,torchdata_shuffle@step=2,torchdata_shuffle@step=2/ddp"
)
"""All of the ``epochs`` scenario's resumes; ``/ddp``: under "ddp"."""


@pytest.fixture(scope="module")
def epochs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("epochs")
    return out, run_nodes(SCRIPT, "epochs", out, 2, EPOCH_CASES)


def test_resumed_in_a_later_epoch_goes_on_in_that_epochs_order(
    epochs: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, ranks = epochs
    saved = out / "node0" / "checkpoints"
    # The checkpoints are what the cases say: (epoch, its batches done, samples this rank's
    # loader has yielded in it).
    for path, want in (
        ("stateful/step=6", (1, 2, 8)),
        ("stateful/step=9", (2, 1, 4)),
        ("stateful/step=8", (1, 4, 16)),
        ("stateful/epoch=1", (1, 4, 16)),
        ("plain/step=4", (0, 4, None)),
    ):
        ckpt = torch.load(saved / f"{path}.ckpt", weights_only=False)
        loop = ckpt["loops"]["fit_loop"]
        batches = loop["epoch_loop.batch_progress"]["current"]["processed"]
        loaders = loop["state_dict"].get("combined_loader")
        position = loaders[0]["_sampler_iter_state"]["samples_yielded"] if loaders else None
        assert (ckpt["epoch"], batches, position) == want, path
    for r in ranks:
        # Each loader sees the same batches, in the sampler's order for each epoch.
        for source in ("plain", "stateful_workers"):
            _assert_exact(r[f"straight/{source}"], r["straight/stateful"])
        for case in EXACT.split(","):
            assert r[case]["global_step"] == 12, case
            _assert_exact(r[case], r["straight/stateful"])


def test_ddp_resumes_a_later_epoch_in_epoch_0s_order(
    epochs: tuple[Path, list[dict[str, Any]]],
) -> None:
    # Under "ddp" a stateful loader resumed in epoch 1, and a loader with a worker process
    # resumed at epoch 0's end, go on in epoch 0's order (Lightning sets the sampler's epoch
    # after making the loader's iterator); at an epoch's end, a plain DataLoader without
    # workers resumes as under BucketDDP.
    for rank, r in enumerate(epochs[1]):
        want = r["straight/stateful"]["weights"]["net.0.weight"]
        for case in ("stateful@step=6/ddp", "plain_workers@step=4/ddp"):
            assert not torch.equal(want, r[case]["weights"]["net.0.weight"]), case
        _assert_like_ddp(r["plain@step=8"]["weights"], r["plain@step=8/ddp"]["weights"], rank, 0.0)


def test_where_resuming_in_a_later_epoch_is_not_exact(
    epochs: tuple[Path, list[dict[str, Any]]],
) -> None:
    # What docs/strategy.md warns of, under "ddp" alike:
    # - a checkpoint saved at an epoch's end (on_train_epoch_end), fitting to max_steps:
    #   Lightning counts the next epoch's first batch in the finished epoch, ends that epoch
    #   after it and goes on in the order of the epoch after;
    # - StatefulDataLoader(shuffle=True) shuffles by torchdata's RandomSampler, which
    #   Lightning wraps (DistributedSamplerWrapper) instead of replacing; each iterator made
    #   of it draws a new order from the sampler's generator, whose state is in no
    #   checkpoint. Resumed in epoch 0 already, the run sees other batches.
    for rank, r in enumerate(epochs[1]):
        for source, file in (("plain", "epoch=1"), ("torchdata_shuffle", "step=2")):
            case = f"{source}@{file}"
            ours, ddp = r[case]["weights"], r[f"{case}/ddp"]["weights"]
            want = r[f"straight/{source}"]["weights"]
            assert not torch.equal(want["net.0.weight"], ours["net.0.weight"]), case
            _assert_like_ddp(ours, ddp, rank)


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
