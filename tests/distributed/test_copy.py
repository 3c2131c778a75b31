"""copy.deepcopy and pickling of the wrapper, against torch DDP's copies on gloo."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from models import assert_weights, batch, build
from multirank import raised, run_ranks


def _steps(model: nn.Module, rank: int, first: int, count: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(first, first + count):
        x, y = batch("conv", step, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _pickled(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded: nn.Module = torch.load(buf, weights_only=False)
    return loaded


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _copies(rank: int, world: int, how: str, wrapper: Callable[..., nn.Module]) -> Any:
    original = wrapper(build("conv"))
    _steps(original, rank, 0, 2)
    duplicate = copy.deepcopy(original) if how == "deepcopy" else _pickled(original)
    _steps(duplicate, rank, 2, 3)  # the copy trains on, synchronized
    _steps(original, rank, 5, 2)  # and so does the original, unaffected
    return _state(duplicate), _state(original), duplicate


def _against_ddp(rank: int, world: int, how: str) -> dict[str, Any]:
    ours_copy, ours_original, duplicate = _copies(rank, world, how, BucketDataParallel)
    theirs_copy, theirs_original, _ = _copies(rank, world, how, DDP)
    return {
        "copy": (ours_copy, theirs_copy),
        "original": (ours_original, theirs_original),
        "order_kept": duplicate.bucket_order is not None,
        "same_group": duplicate.reducer.process_group is None,
    }


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_trains_synchronized_like_torch_ddps_copy(how: str) -> None:
    results = run_ranks(_against_ddp, 2, how, timeout=90)
    for rank, r in enumerate(results):
        for ours, theirs in (r["copy"], r["original"]):
            assert_weights(ours, theirs, rank)  # parameters and BatchNorm buffers
        assert r["order_kept"] and r["same_group"]
    # Synchronized: the ranks' parameters agree (before, a copy trained each rank alone).
    weight = [r["copy"][0]["head.weight"] for r in results]
    torch.testing.assert_close(weight[0], weight[1], rtol=0, atol=0)


def _sum_buffer_after_copy_load(rank: int, world: int) -> dict[str, Any]:
    net = build("conv")
    net.register_buffer("seen", torch.zeros((), dtype=torch.int64))
    model = BucketDataParallel(net, buffer_sync={"seen": "sum"})
    net.seen += rank + 1  # unsynced local additions
    # A copy of the inner module (an EMA, say) loads a state: the original's "sum"
    # baseline must not move, or its next sync would lose the additions.
    shadow = copy.deepcopy(net)
    shadow.load_state_dict(net.state_dict())
    model.sync_buffers()
    # A copy of the wrapper keeps the agreed total as its baseline, and syncs on its own.
    duplicate = _pickled(model)
    duplicate.module.seen += 1
    duplicate.sync_buffers()
    group = dist.new_group([0, 1])
    return {
        "seen": int(net.seen),
        "pickled": int(_pickled(net).seen),  # a wrapped module with "sum" buffers pickles
        "copy_seen": int(duplicate.module.seen),
        "own_group": raised(
            lambda: copy.deepcopy(BucketDataParallel(build("mlp"), process_group=group))
        ),
    }


def test_copies_leave_the_original_alone_and_own_groups_refuse() -> None:
    for r in run_ranks(_sum_buffer_after_copy_load, 2, timeout=60):
        assert r["seen"] == r["pickled"] == 1 + 2
        assert r["copy_seen"] == 3 + 1 + 1
        assert "cannot be copied or pickled" in r["own_group"]
        assert "Copy model.module instead" in r["own_group"]


def _save(rank: int, world: int) -> bytes:
    buf = io.BytesIO()
    torch.save(BucketDataParallel(build("mlp"), find_unused_parameters=True), buf)
    return buf.getvalue()


def _replace_after_loading(rank: int, world: int, saved: list[bytes]) -> str:
    # A fresh process that never built a wrapper itself.
    model = torch.load(io.BytesIO(saved[rank]), weights_only=False)
    _steps_mlp(model, rank)
    model.module.net[4] = nn.Linear(32, 4)  # on every rank
    return raised(lambda: _steps_mlp(model, rank))


def _steps_mlp(model: nn.Module, rank: int) -> None:
    x, y = batch("mlp", 0, rank)
    F.mse_loss(model(x), y).backward()


def test_a_wrapper_loaded_in_a_new_process_still_notices_replaced_layers() -> None:
    # Before, the registration counter was started only by a wrapper's __init__, so in a
    # process that only loaded one the check was off: each rank trained the new layer on
    # its own gradient.
    saved = run_ranks(_save, 2, timeout=60)
    for said in run_ranks(_replace_after_loading, 2, saved, timeout=60):
        assert "the wrapped module gained parameters after wrapping, on 2 of 2 ranks" in said
