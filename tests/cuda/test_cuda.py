"""The engine, SyncBatchNorm and BucketDDP on CUDA tensors; skipped on a machine with no GPU.

CI has no GPU: these run where one is (see "Development" in the README). With one GPU, two
ranks share it over gloo, which reduces CUDA tensors (NCCL refuses two ranks on one device);
with two or more GPUs, the ranks use NCCL, one GPU each. At world size 1 over NCCL, torch
DDP runs its collectives and bucketddp launches none (it has nothing to reduce). The ground
truths are those of the CPU tests: torch DDP on the same device, and single-process training
on the global batch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from bucketddp import BucketDataParallel, convert_sync_batchnorm, revert_sync_batchnorm
from engine_cases import CASES, TINY, assert_same_as_ddp, train_both
from finite_cases import assert_named_and_recovered, train_configs
from lightning_runs import SCENARIOS, assert_same, moved, run_script
from multirank import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
BACKEND = "nccl" if TWO_GPUS else "gloo"


def _on_cuda(rank: int, world: int, name: str, opts: dict[str, Any], kw: dict[str, Any]) -> Any:
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return train_both(rank, world, name, opts, {**kw, "device": "cuda"})


@pytest.mark.parametrize(
    "case",
    [
        "mlp",
        "conv",
        "tied",
        "mixed_dtype",
        "tiny_buckets",
        "no_view",
        "zero_grad_keep",
        "no_sync_accumulation",
        "unused_by_rank",
    ],
)
def test_matches_torch_ddp_on_cuda(case: str) -> None:
    name, opts, kw = CASES[case]
    assert_same_as_ddp(run_ranks(_on_cuda, 2, name, opts, kw, backend=BACKEND, timeout=180))


def test_finite_check_on_cuda_names_rank1_and_trains_on() -> None:
    # The fused way (one norm kernel per bucket), as on every accelerator.
    configs = ["plain", "comm_hook", "no_sync", "unused"]
    results = run_ranks(train_configs, 2, configs, "cuda", backend=BACKEND, timeout=180)
    for config in configs:
        assert_named_and_recovered(results, config)


def test_nccl_at_world_size_1_matches_torch_ddp() -> None:
    assert_same_as_ddp(run_ranks(_on_cuda, 1, "mlp", TINY, {}, backend="nccl", timeout=180))


def _views(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 8)).cuda()
    wrapped = BucketDataParallel(model, bucket_cap_mb=0.002, first_bucket_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    storages = []
    for step, set_to_none in enumerate((True, False, True)):
        x = torch.randn(4, 64, device="cuda") + rank + step
        wrapped(x).square().mean().backward()
        # One storage per bucket, on the GPU: every .grad is a view of its bucket.
        by_bucket = [
            {model.get_parameter(n).grad.untyped_storage().data_ptr() for n in b.names}
            for b in wrapped.bucket_plan
        ]
        storages.append([sorted(s) for s in by_bucket])
        assert all(p.grad.is_cuda for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return {"storages": storages, "buckets": len(wrapped.bucket_plan)}


def test_grads_are_bucket_views_on_cuda() -> None:
    for r in run_ranks(_views, 2, backend=BACKEND, timeout=120):
        assert r["buckets"] == 3
        for step in r["storages"]:
            assert all(len(s) == 1 for s in step), step
            assert len({s[0] for s in step}) == r["buckets"]  # a storage of its own each


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(128, 4)
    ).double()


def _bn_data(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(rows, 3, 4, 4, generator=g, dtype=torch.float64) * 2 + 1,
         torch.randn(rows, 4, generator=g, dtype=torch.float64))
        for _ in range(steps)
    ]  # fmt: skip


def _syncbn(rank: int, world: int, steps: int, per_rank: int) -> dict[str, torch.Tensor]:
    model = BucketDataParallel(convert_sync_batchnorm(_bn_net()).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _bn_data(steps, per_rank * world):
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = nn.functional.mse_loss(model(x[rows].cuda()), y[rows].cuda())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.cpu() for k, v in revert_sync_batchnorm(model.module).state_dict().items()}


def test_syncbatchnorm_on_cuda_matches_the_global_batch() -> None:
    steps, per_rank = 3, 4
    results = run_ranks(_syncbn, 2, steps, per_rank, backend=BACKEND, timeout=120)
    model = _bn_net()  # float64 on the CPU: the same arithmetic to ~1e-15
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _bn_data(steps, per_rank * 2):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for rank, state in enumerate(results):
        for name, want in model.state_dict().items():
            torch.testing.assert_close(state[name], want, rtol=0, atol=1e-9, msg=f"{name}@{rank}")


def test_bucket_ddp_on_one_gpu_matches_strategy_ddp(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    run_script([sys.executable, str(SCENARIOS), "cuda", str(tmp_path)], timeout=240)
    (result,) = [torch.load(f, weights_only=False) for f in tmp_path.glob("cuda.rank*.pt")]
    for name in ("boring", "boring_bf16", "transformer_acc2", "normed"):
        assert result[f"{name}/bucket/backend"] == result[f"{name}/ddp/backend"] == "nccl"
        assert_same(result[f"{name}/bucket"], result[f"{name}/ddp"], tol=1e-6)
        assert moved(result[f"{name}/init"], result[f"{name}/bucket"]), f"{name} did not train"


def _auto_and_timings(rank: int, world: int) -> dict[str, Any]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()

    ours = BucketDataParallel(make(), bucket_cap_mb="auto")
    theirs = nn.parallel.DistributedDataParallel(make())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    worst, ordered = 0.0, True
    for step in range(16):
        x = torch.randn(8, 64, device="cuda", generator=None) + rank + step
        for model, opt in zip((ours, theirs), opts, strict=True):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        timings = ours.comm_stats.bucket_timings
        ordered &= bool(timings) and all(
            t.ready <= t.launched <= t.completed <= t.waited for t in timings
        )
        for a, b in zip(ours.module.parameters(), theirs.module.parameters(), strict=True):
            worst = max(worst, (a - b).abs().max().item())
    return {"worst": worst, "ordered": ordered, "choice": ours.tuned_bucket_sizes}


def test_auto_bucket_sizes_and_timings_on_cuda() -> None:
    results = run_ranks(_auto_and_timings, 2, backend=BACKEND, timeout=180)
    for r in results:
        assert r["worst"] < 1e-5 and r["ordered"] and r["choice"] is not None, r
    assert results[0]["choice"] == results[1]["choice"]
