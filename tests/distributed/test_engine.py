"""BucketDataParallel against torch's DistributedDataParallel on real gloo process groups."""

from __future__ import annotations

import collections
import itertools
import re
import subprocess
import sys
import time
import warnings
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from bucketddp.forward_io import to_device
from bucketddp.placement import input_device
from engine_cases import CASES, TINY, assert_same_as_ddp, train_both
from models import (
    assert_pairs_match,
    assert_weights,
    batch,
    build,
    paired,
    split_flags,
    train,
    train_global,
)
from multirank import RankError, raised, run_ranks

COMPAT_CASES = ("conv", "no_sync_accumulation", "unused_by_rank")  # dev.py compat runs these


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.compat("engine")) if c in COMPAT_CASES else c
        for c in CASES
    ],
)
def test_matches_torch_ddp(case: str) -> None:
    name, opts, kw = CASES[case]
    assert_same_as_ddp(run_ranks(train_both, 2, name, opts, kw))


@pytest.mark.parametrize("world", [1, 3])
def test_matches_torch_ddp_other_world_sizes(world: int) -> None:
    assert_same_as_ddp(run_ranks(train_both, world, "mlp", TINY, {}))


def _subgroups(rank: int, world: int) -> dict[str, Any]:
    # Ranks 0 and 2 train together on their own group; rank 1 alone on another.
    groups = [dist.new_group([0, 2]), dist.new_group([1])]
    mine = groups[1] if rank == 1 else groups[0]
    ours = train("conv", partial(BucketDataParallel, process_group=mine, **TINY), rank)
    theirs = train("conv", partial(DDP, process_group=mine, bucket_cap_mb=0.002), rank)
    return paired(ours, theirs)


def test_matches_torch_ddp_on_subgroups() -> None:
    results = run_ranks(_subgroups, 3, timeout=90)
    assert_pairs_match(results)
    # The pair agrees; the lone rank trained on its own data.
    params = [r["params"][0]["head.weight"] for r in results]
    assert torch.equal(params[0], params[2]) and not torch.equal(params[0], params[1])


def test_weights_actually_move() -> None:
    """Guards the comparisons above: a few steps change every trainable parameter."""
    start = build("branchy")
    out = train("branchy", lambda m: m, 0, steps=3)["params"]
    for n, p in start.named_parameters():
        if not n.startswith("never") and not n.startswith("right"):
            assert not torch.equal(p, out[n]), n


def _single_process_reference(steps: int, world: int) -> dict[str, torch.Tensor]:
    model = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        xs, ys = zip(*(batch("mlp", step, r) for r in range(world)), strict=True)
        loss = F.mse_loss(model(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _ours_only(rank: int, world: int) -> dict[str, torch.Tensor]:
    return train("mlp", partial(BucketDataParallel, **TINY), rank)["params"]


def test_matches_single_process_on_global_batch() -> None:
    results = run_ranks(_ours_only, 2)
    expected = _single_process_reference(4, 2)
    for r in results:
        for n, p in expected.items():
            assert torch.allclose(r[n], p, atol=1e-6, rtol=0), n


def _reentrant_unused(rank: int, world: int, view: bool) -> dict[str, torch.Tensor]:
    opts = {"find_unused_parameters": True, "gradient_as_bucket_view": view}
    return train("reentrant", partial(BucketDataParallel, **opts, **TINY), rank)["params"]


@pytest.mark.parametrize("view", [True, False])
def test_reentrant_checkpointing_with_find_unused_matches_global_batch(view: bool) -> None:
    # The first gradients come from a nested backward (the second segment's); the step must
    # still end with the outer one. torch DDP raises "Expected to mark a variable ready only
    # once" here, so the ground truth is one process.
    expected = train_global("reentrant", [4, 4])
    for rank, params in enumerate(run_ranks(_reentrant_unused, 2, view)):
        for n, want in expected.items():
            torch.testing.assert_close(params[n], want, rtol=0, atol=1e-6, msg=f"{n} {rank}")


class ReturnsParameter(torch.nn.Module):
    """Returns one of its parameters beside the prediction (say, a learned temperature)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(10, 4)
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.scale


def _returns_parameter(rank: int, world: int, wrapper: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = wrapper(ReturnsParameter())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        x, y = batch("mlp", step, rank)
        pred, scale = model(x)
        F.mse_loss(pred * scale, y).backward()
        opt.step()
        opt.zero_grad()
    hooks = model.module.scale._backward_hooks
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {"params": params, "hooks": len(hooks or {})}


def test_a_returned_parameter_trains_as_in_torch_ddp_and_collects_no_hooks() -> None:
    ours = run_ranks(_returns_parameter, 2, BucketDataParallel)
    theirs = run_ranks(_returns_parameter, 2, DDP)
    for mine, want in zip(ours, theirs, strict=True):
        assert mine["hooks"] == 0
        for n, p in want["params"].items():
            torch.testing.assert_close(mine["params"][n], p, rtol=0, atol=1e-6, msg=n)


def _views_and_plan(rank: int, world: int, set_to_none: bool) -> dict[str, Any]:
    model = build("mixed")
    ddp = BucketDataParallel(model, **TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    storages = []
    for step in range(3):
        x, y = batch("mixed", step, rank)
        F.mse_loss(ddp(x), y).backward()
        # After the first step the plan is rebuilt; the views must follow the new storage.
        storages.append(
            {
                n: p.grad.untyped_storage().data_ptr()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        )
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    reducer = ddp.reducer
    bucket_ptrs = {b.storage.untyped_storage().data_ptr() for b in reducer.buckets}
    plan = ddp.bucket_plan
    return {
        "last": storages[-1],
        "bucket_ptrs": bucket_ptrs,
        "n_params": sum(1 for p in model.parameters()),
        "plan": [(b.names, b.numel, b.nbytes, b.dtype) for b in plan],
        "learned": plan.learned,
    }


@pytest.mark.parametrize("set_to_none", [True, False])
def test_grads_are_bucket_views(set_to_none: bool) -> None:
    for r in run_ranks(_views_and_plan, 2, set_to_none):
        assert len(r["last"]) == r["n_params"]
        assert set(r["last"].values()) <= r["bucket_ptrs"]
        assert r["learned"]
        for names, numel, nbytes, dtype in r["plan"]:
            assert names and numel > 0
            assert nbytes == numel * torch.empty((), dtype=dtype).element_size()
        # Buckets never mix dtypes: float64 params sit in float64 buckets only.
        dtypes = {n: dt for names, _, _, dt in r["plan"] for n in names}
        assert all(dt == torch.float64 for n, dt in dtypes.items() if n.startswith("b."))
        assert all(dt == torch.float32 for n, dt in dtypes.items() if not n.startswith("b."))


def _uneven_accumulation(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 accumulates two no_sync() micro-batches before the first synced backward."""
    out: dict[str, Any] = {}
    for wrap in (BucketDataParallel, DDP):
        model = build("mlp")
        ddp = wrap(model, **TINY) if wrap is BucketDataParallel else wrap(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            for micro in range(2 if rank == 0 and step == 0 else 0):
                with ddp.no_sync():
                    x, y = batch("mlp", 10 + micro, rank)
                    F.mse_loss(ddp(x), y).backward()
            x, y = batch("mlp", step, rank)
            F.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
        out[wrap.__name__] = [p.detach().clone() for p in model.parameters()]
        if isinstance(ddp, BucketDataParallel):
            out["plan"] = [b.names for b in ddp.bucket_plan]
    return out


def test_uneven_no_sync_before_the_first_sync_rebuilds_alike_and_matches_torch_ddp() -> None:
    # The observed order spans every backward up to the first synced one, so the ranks saw
    # different numbers of gradients: the rebuild must still send rank 0's order in a
    # tensor of the same size on every rank (sent with repeats, gloo aborts on the sizes).
    results = run_ranks(_uneven_accumulation, 2)
    assert results[0]["plan"] == results[1]["plan"]
    for r in results:
        for ours, theirs in zip(r["BucketDataParallel"], r["DistributedDataParallel"], strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def _layouts(rank: int, world: int) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = train("channels_last", BucketDataParallel, rank, set_to_none=False)
    model = out["wrapped"].module
    return {
        "warnings": [str(w.message) for w in caught if "layout contract" in str(w.message)],
        "strides_match": all(p.grad.stride() == p.stride() for p in model.parameters()),
        "views": all(
            p.grad.data_ptr() == v.data_ptr()
            for p, v in zip(model.parameters(), out["wrapped"].reducer.views, strict=True)
        ),
    }


def test_bucket_views_keep_the_parameters_layout() -> None:
    # channels_last conv weights: each gradient view takes its parameter's strides, as
    # torch DDP's bucket views do, so AccumulateGrad sees the layout it expects.
    for r in run_ranks(_layouts, 2, timeout=60):
        assert r["warnings"] == []
        assert r["strides_match"] and r["views"]


def _count_collectives(rank: int, world: int) -> dict[str, Any]:
    model = build("mlp")
    ddp = BucketDataParallel(model, **TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = []
    for step in range(4):
        x, y = batch("mlp", step, rank)
        with torch.profiler.profile() as prof:
            F.mse_loss(ddp(x), y).backward()
        counts.append(sum(1 for e in prof.events() if e.name.startswith("c10d::")))
        opt.step()
        opt.zero_grad()
    return {"counts": counts, "buckets": len(ddp.bucket_plan), "stats": ddp.comm_stats}


def test_one_collective_per_bucket_per_step() -> None:
    for r in run_ranks(_count_collectives, 2):
        assert r["buckets"] >= 3
        # Step 0 also broadcasts rank 0's learned order once; steps after it reduce only.
        assert r["counts"][1:] == [r["buckets"]] * 3
        assert r["stats"].collectives == r["buckets"]
        assert r["stats"].bytes_reduced > 0
        assert r["stats"].wait_seconds >= 0


def _plans_agree_despite_different_orders(rank: int, world: int) -> list[tuple[str, ...]]:
    model = build("branchy")
    ddp = BucketDataParallel(model, find_unused_parameters=True, **TINY)
    x, y = batch("branchy", 0, rank)
    F.mse_loss(ddp(x, use_left=rank == 0), y).backward()
    return [b.names for b in ddp.bucket_plan]


def test_rank0_order_wins_when_ranks_observe_different_orders() -> None:
    plans = run_ranks(_plans_agree_despite_different_orders, 2)
    assert plans[0] == plans[1]
    # Rank 0 used "left": its order puts left's gradients before right's (unused there).
    order = [n for names in plans[0] for n in names]
    assert order.index("left.weight") < order.index("right.weight")


def _unused_error(rank: int, world: int) -> dict[str, Any]:
    model = build("branchy")
    ddp = BucketDataParallel(model, **TINY)
    x, y = batch("branchy", 0, rank)
    start = time.monotonic()
    try:
        # Rank 1 takes the other branch, so "left" gets no gradient there.
        F.mse_loss(ddp(x, use_left=rank == 0), y).backward()
    except RuntimeError as e:
        message = str(e)
    else:
        message = ""
    elapsed = time.monotonic() - start
    # The reducer must be usable again after the error: a clean step goes through.
    ddp_ok = BucketDataParallel(build("mlp"))
    xm, ym = batch("mlp", 0, rank)
    F.mse_loss(ddp_ok(xm), ym).backward()
    return {"message": message, "elapsed": elapsed}


def test_unused_parameter_error_is_prompt_and_on_every_rank() -> None:
    for r in run_ranks(_unused_error, 2, timeout=30):
        assert "find_unused_parameters=True" in r["message"]
        assert "'left.weight'" in r["message"] and "'never.weight'" in r["message"]
        assert r["elapsed"] < 5.0


def _create_graph(rank: int, world: int, view: bool) -> tuple[str, dict[str, torch.Tensor]]:
    """backward(create_graph=True) raises; the steps after it train as usual."""
    model = build("mlp")
    wrapped = BucketDataParallel(model, gradient_as_bucket_view=view)
    x, y = batch("mlp", 0, rank)
    message = raised(lambda: F.mse_loss(wrapped(x), y).backward(create_graph=True))
    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(2):
        x, y = batch("mlp", step, rank)
        F.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
    return message, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("view", [True, False])
def test_create_graph_is_refused_by_name_on_every_rank(view: bool) -> None:
    # torch DDP fails here too, with autograd's "a leaf Variable that requires grad is being
    # used in an in-place operation"; before, ours failed with "mul(): functions with out=...
    # arguments don't support automatic differentiation".
    want = train_global("mlp", [2, 2])
    for rank, (message, params) in enumerate(run_ranks(_create_graph, 2, view, timeout=60)):
        assert "has a gradient that requires grad: backward(create_graph=True)" in message
        assert "torch.autograd.grad(" in message
        assert_weights(params, want, rank)


def _rows_forced(rank: int, world: int, case: str) -> Any:
    # Each rank writes its flags in row rank % rows, added up in float64 after the sum.
    split_flags(lambda world_size: min(2, world_size))
    if case == "unused_error":
        return _unused_error(rank, world)
    return train_both(rank, world, *CASES[case])


@pytest.mark.parametrize(("case", "world"), [("unused_by_rank", 3), ("frozen", 2)])
def test_flags_in_several_rows_give_the_weights_of_torch_ddp(case: str, world: int) -> None:
    assert_same_as_ddp(run_ranks(_rows_forced, world, case))


def test_flags_in_several_rows_still_name_unused_parameters() -> None:
    for r in run_ranks(_rows_forced, 2, "unused_error", timeout=30):
        assert "'left.weight'" in r["message"] and "'never.weight'" in r["message"]


def _complex_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 6, dtype=torch.complex64, generator=g), torch.randn(4, 3, generator=g)


def _complex(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    opts = dict(opts)
    hook = opts.pop("comm_hook", None)
    out = {}
    for name, wrap in (("ours", BucketDataParallel), ("theirs", DDP)):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3).to(torch.complex64)
        try:
            wrapped = wrap(model, **opts)
        except RuntimeError as err:
            if name == "ours" or "Invalid scalar type" not in str(err):
                raise
            # torch DDP of 2.6 and older cannot broadcast complex parameters as it wraps them:
            # there the ground truth is one process on the global batch.
            wrapped, world_batches = model, True
        else:
            world_batches = False
        if hook is not None and wrapped is not model:
            wrapped.register_comm_hook(None, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            batches = [_complex_batch(step, r) for r in (range(world) if world_batches else [rank])]
            x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
            (wrapped(x).abs() - y).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        out[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize(
    "opts",
    [
        {"find_unused_parameters": True},
        {"static_graph": True},
        {"comm_hook": default_hooks.allreduce_hook},
    ],
)
def test_complex_parameters_give_the_weights_of_torch_ddp(opts: dict[str, Any]) -> None:
    # The flags ride in the last bucket, complex here. Before, reading them compared complex
    # numbers ("'>' not supported"): every backward raised with these options. A hook's
    # all-reduce of a complex bucket hands back its real view: before, that was refused as
    # a future of the wrong size.
    for rank, r in enumerate(run_ranks(_complex, 2, opts)):
        assert_weights(r["ours"], r["theirs"], rank)


class _FailOnce(torch.autograd.Function):
    """Identity in forward; raises in backward the first time, on every rank."""

    armed = True

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise ValueError("boom")
        return g


def _recover_after_failed_backward(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = build("mlp")
    ddp = BucketDataParallel(model, **TINY)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x, y = batch("mlp", step, rank)
        if step == 0:
            # A backward that raises halfway, on every rank: the head's hooks have fired
            # and its bucket is in flight, the first layer's gradients never come.
            net = ddp.module.net
            _FailOnce.armed = True
            with pytest.raises(ValueError, match="boom"):
                F.mse_loss(net[2:](_FailOnce.apply(net[:2](x))), y).backward()
            opt.zero_grad()
            continue
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_training_recovers_after_a_failed_backward() -> None:
    # torch DDP refuses to go on after an unfinished reduction, so the ground truth is one
    # process on the global batch, with the failed step skipped.
    model = build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in (1, 2):
        xs, ys = zip(*(batch("mlp", step, r) for r in range(2)), strict=True)
        F.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    for r in run_ranks(_recover_after_failed_backward, 2):
        for n, p in model.named_parameters():
            assert torch.allclose(r[n], p.detach(), atol=1e-6, rtol=0), n


def _wrap_error(model: torch.nn.Module) -> str:
    """The message of the RuntimeError that wrapping ``model`` raises, or "" if none."""
    try:
        BucketDataParallel(model)
    except RuntimeError as e:
        return str(e)
    return ""


def _mismatch(rank: int, world: int) -> str:
    return _wrap_error(build("mlp") if rank == 0 else build("frozen"))


def test_model_mismatch_raises_on_every_rank() -> None:
    messages = run_ranks(_mismatch, 2, timeout=30)
    for m in messages:
        assert "rank 1 differs from rank 0" in m
        assert "net.0.weight" in m
    assert messages[0] == messages[1]


def _shape_mismatch(rank: int, world: int) -> str:
    return _wrap_error(torch.nn.Linear(4, 3 + rank))


def test_shape_mismatch_names_parameter() -> None:
    for m in run_ranks(_shape_mismatch, 2, timeout=30):
        assert "'weight'" in m and "[3, 4]" in m and "[4, 4]" in m


def _mixed_init() -> torch.nn.Module:
    # Odd sizes and three dtypes (float32, float64, int64 counters) in one broadcast.
    return torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 7).double()
    )


def _initial_broadcast(rank: int, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(rank)  # a different init on every rank
    model = _mixed_init()
    with torch.no_grad():
        model[1].running_mean.fill_(rank)
        model[1].num_batches_tracked.fill_(10 + rank)
    BucketDataParallel(model)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_parameters_and_buffers_start_from_rank0() -> None:
    states = run_ranks(_initial_broadcast, 3)
    torch.manual_seed(0)
    expected = _mixed_init()
    with torch.no_grad():
        expected[1].running_mean.fill_(0)
        expected[1].num_batches_tracked.fill_(10)
    for state in states:
        assert state.keys() == expected.state_dict().keys()
        for k, v in expected.state_dict().items():
            assert state[k].dtype == v.dtype and torch.equal(state[k], v), k


def test_requires_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        BucketDataParallel(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        # A string from a command line: "False" is true, so it would switch the option on.
        (
            "find_unused_parameters",
            "False",
            "find_unused_parameters must be True or False, got str 'False'",
        ),
        ("gradient_as_bucket_view", None, "gradient_as_bucket_view must be True or False"),
        ("static_graph", 2, "static_graph must be True or False, got int 2"),
        ("init_sync", "yes", "init_sync must be True or False"),
        ("broadcast_buffers", "no", "broadcast_buffers must be True, False or None, got str"),
        ("forward_sync_buffers", 0.5, "forward_sync_buffers must be True, False or None"),
    ],
)
def test_on_off_options_refuse_anything_but_a_bool_by_name(
    option: str, value: object, message: str
) -> None:
    # Checked before anything else, so no process group is needed to see it.
    with pytest.raises(TypeError, match=message):
        BucketDataParallel(torch.nn.Linear(2, 2), **{option: value})


def test_on_off_options_take_zero_and_one_as_torch_ddp_does() -> None:
    from bucketddp.options import check_switches

    check_switches(find_unused_parameters=1, static_graph=0, broadcast_buffers=None)


def test_bad_bucket_size_is_rejected() -> None:
    with pytest.raises(RankError, match="bucket_cap_mb"):
        run_ranks(_bad_cap, 2, timeout=30)


@pytest.mark.parametrize(
    ("caps", "per_bucket"),
    [
        # torch DDP's own default value: 25 MB, one bucket for the whole small MLP here.
        ({"bucket_cap_mb": None, "first_bucket_mb": 25.0}, None),
        # Below one gradient's size, as torch DDP accepts: a bucket per parameter.
        ({"bucket_cap_mb": 1e-7, "first_bucket_mb": 1e-7}, 1),
    ],
)
def test_torch_ddp_bucket_sizes_are_accepted(caps: dict[str, Any], per_bucket: int | None) -> None:
    results = run_ranks(train_both, 2, "mlp", caps, {})
    assert_same_as_ddp(results)
    plan = results[0]["plan"]
    if per_bucket is None:
        assert len(plan) == 1
    else:
        assert len(plan) > 1 and all(len(names) == per_bucket for names in plan)


def _bad_cap(rank: int, world: int) -> None:
    BucketDataParallel(torch.nn.Linear(2, 2), bucket_cap_mb=0)


def _lazy(rank: int, world: int) -> str:
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.LazyBatchNorm1d())
    return raised(lambda: BucketDataParallel(lazy))


def test_lazy_modules_are_refused_naming_what_to_do() -> None:
    # torch DDP refuses them too; before, bucketddp raised torch's message about
    # load_state_dict, which did not apply.
    for said in run_ranks(_lazy, 2, timeout=30):
        assert "['0.weight', '0.bias', '1.weight', '1.bias', '1.running_mean'" in said
        assert "run one forward pass on a batch first" in said


def _bad_wrapping(rank: int, world: int) -> dict[str, str]:
    inner = torch.nn.Linear(2, 2)
    with torch.device("meta"):
        on_meta = torch.nn.Linear(2, 2)
    return {
        "ours": raised(lambda: BucketDataParallel(BucketDataParallel(inner)), ValueError),
        "torch": raised(lambda: BucketDataParallel(DDP(inner)), ValueError),
        "nested": raised(
            lambda: BucketDataParallel(torch.nn.Sequential(DDP(inner), torch.nn.ReLU())),
            ValueError,
        ),
        "meta": raised(lambda: BucketDataParallel(on_meta)),
        "function": raised(lambda: BucketDataParallel(torch.relu), TypeError),  # type: ignore[arg-type]
        "group": raised(
            lambda: BucketDataParallel(inner, process_group="gloo"),  # type: ignore[arg-type]
            TypeError,
        ),
    }


def test_wrapping_a_wrapper_or_a_meta_module_is_refused_naming_the_fix() -> None:
    # torch DDP takes a wrapper inside a wrapper and reduces its gradients twice; a meta
    # module, a function or a string for the group fail with unrelated errors. Before, so did
    # bucketddp (the meta module at its first forward).
    for said in run_ranks(_bad_wrapping, 2, timeout=30):
        assert "it is already a BucketDataParallel" in said["ours"]
        assert "it is already a DistributedDataParallel" in said["torch"]
        assert "its submodule '0' is a DistributedDataParallel" in said["nested"]
        for key in ("ours", "torch", "nested"):
            assert "pass wrapper.module instead" in said[key]
        assert "['weight', 'bias'] are on the meta device" in said["meta"]
        assert "module.to_empty(device=...)" in said["meta"]
        assert "wraps an nn.Module, got builtin_function_or_method" in said["function"]
        assert "must be a torch.distributed.ProcessGroup" in said["group"]
        assert "str 'gloo'" in said["group"]


def _nothing_to_train(rank: int, world: int) -> dict[str, Any]:
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    torch.nn.init.constant_(frozen.weight, float(rank))
    ignored = torch.nn.Linear(2, 2)
    ignored.weight.requires_grad_(False)
    BucketDataParallel._set_params_and_buffers_to_ignore_for_model(ignored, ["bias"])
    return {
        "frozen": raised(lambda: BucketDataParallel(frozen), ValueError),
        "weight": frozen.weight[0, 0].item(),
        "ignored": raised(lambda: BucketDataParallel(ignored), ValueError),
    }


def test_a_module_with_nothing_to_train_is_refused_before_any_broadcast() -> None:
    # torch DDP refuses it too. The ranks agree on requires_grad in the model check, so the
    # error comes on every rank, and before parameters are broadcast: each keeps its own.
    for rank, said in enumerate(run_ranks(_nothing_to_train, 2, timeout=30)):
        for key in ("frozen", "ignored"):
            assert "needs at least one parameter with requires_grad=True" in said[key]
            assert "Unfreeze the parameters to train" in said[key]
        assert said["weight"] == float(rank)


def _device_ids_on_cpu(rank: int, world: int) -> dict[str, str]:
    """What each wrapper says to torch DDP's device arguments on a CPU module."""
    said = {}
    for label, kwargs in {
        "device_ids": {"device_ids": [rank]},
        # Not an integer: torch DDP lets output_device=0 pass on a CPU module (it tests the
        # value's truth), so its ranks would disagree and hang in the next collective.
        "output_device": {"output_device": "cuda:0"},
        "empty": {"device_ids": []},
    }.items():
        for system, wrap in (("ours", BucketDataParallel), ("torch", DDP)):
            try:
                wrap(build("mlp"), **kwargs)
                said[f"{label}/{system}"] = "ok"
            except ValueError as e:
                said[f"{label}/{system}"] = str(e)
    return said


def test_device_arguments_follow_torch_ddp_on_cpu() -> None:
    # torch DDP's own keywords are accepted; a CPU module refuses a device, as torch DDP's
    # does, on every rank before any collective, and ``[]`` means none.
    for said in run_ranks(_device_ids_on_cpu, 2, timeout=60):
        for label in ("device_ids", "output_device"):
            assert said[f"{label}/torch"] != "ok"
            assert "module's parameters are on cpu" in said[f"{label}/ours"]
            assert "pass neither (the default) for a CPU module" in said[f"{label}/ours"]
        assert said["empty/ours"] == said["empty/torch"] == "ok"


@pytest.mark.parametrize(
    ("devices", "device_ids", "output_device", "expected"),
    [
        ({"cuda:1"}, [1], None, "cuda:1"),
        ({"cuda:1"}, ["cuda:1"], 1, "cuda:1"),
        ({"cuda:1"}, ["cuda"], None, "cuda:1"),  # no index: the module's own, as torch DDP
        ({"cuda:1"}, [torch.device("cuda", 1)], "cuda:1", "cuda:1"),
        ({"cuda:0"}, None, None, None),
        ({"cpu"}, [], None, None),
    ],
)
def test_device_ids_name_the_module_device(
    devices: set[str], device_ids: Any, output_device: Any, expected: str | None
) -> None:
    got = input_device({torch.device(d) for d in devices}, device_ids, output_device)
    assert got == (None if expected is None else torch.device(expected))


@pytest.mark.parametrize(
    ("devices", "device_ids", "output_device", "message"),
    [
        ({"cuda:0"}, [0, 1], None, "give exactly one device per process"),
        ({"cuda:0"}, [1], None, "device_ids[0] names cuda:1, but the module's parameters are"),
        ({"cuda:0"}, [0], "cuda:1", "output_device names cuda:1"),
        ({"cuda:0", "cuda:1"}, [0], None, "cuda:0, cuda:1; pass neither for a module that spans"),
    ],
)
def test_device_ids_that_miss_the_module_device_are_refused(
    devices: set[str], device_ids: Any, output_device: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        input_device({torch.device(d) for d in devices}, device_ids, output_device)


def test_inputs_move_to_the_device_through_containers() -> None:
    point = collections.namedtuple("point", "x y")
    inputs = (
        torch.ones(2),
        [torch.ones(1), 3, "text"],
        {"p": point(torch.ones(3), None)},
        collections.defaultdict(list, {"d": torch.zeros(1)}),
    )
    moved = to_device(inputs, torch.device("meta"))
    assert moved[0].is_meta and moved[1][0].is_meta and moved[1][1:] == [3, "text"]
    assert type(moved[2]["p"]) is point and moved[2]["p"].x.is_meta and moved[2]["p"].y is None
    assert type(moved[3]) is collections.defaultdict and moved[3]["d"].is_meta
    assert not inputs[0].is_meta  # the originals stay where they were


def test_import_does_not_pull_lightning() -> None:
    code = (
        "import sys, bucketddp; "
        "assert not any(m == 'lightning' or m.startswith(('lightning.', 'pytorch_lightning')) "
        "for m in sys.modules), sorted(m for m in sys.modules if 'lightning' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _kept_gradients(rank: int, world: int) -> dict[str, Any]:
    """Two losses, the first one's gradients kept across zero_grad (PCGrad-style)."""
    out = {}
    for name, wrap, keep in (
        ("torch", DDP, None),
        ("views", BucketDataParallel, None),
        ("views, detached", BucketDataParallel, torch.Tensor.detach),
        ("copies", partial(BucketDataParallel, gradient_as_bucket_view=False), None),
    ):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        ddp = wrap(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        kept_intact = []
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(3, 4, generator=g)
            ddp(x).pow(2).sum().backward()
            first = [p.grad if keep is None else keep(p.grad) for p in model.parameters()]
            copies = [f.clone() for f in first]
            opt.zero_grad(set_to_none=True)
            ddp(x).sum().backward()
            kept_intact.append(all(torch.equal(f, c) for f, c in zip(first, copies, strict=True)))
            for p, f in zip(model.parameters(), first, strict=True):
                p.grad = p.grad + f
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = (kept_intact, [p.detach().clone() for p in model.parameters()])
    # A tensor taken on a gradient during the backward (a hook registered after wrapping)
    # shares the reduced gradient, as with torch DDP: the bucket does not move under it.
    for name, wrap in (("torch", DDP), ("views", BucketDataParallel)):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        ddp = wrap(model)
        taken: list[torch.Tensor] = []
        last = model[1].weight  # ready early in the backward; the first layer's come later
        last.register_post_accumulate_grad_hook(
            lambda p, taken=taken: taken.append(p.grad.detach())
        )
        for _ in range(2):
            ddp(torch.randn(3, 4)).sum().backward()
            model.zero_grad(set_to_none=True)
        ddp(torch.randn(3, 4)).sum().backward()
        out[f"{name} in backward"] = taken[-1].data_ptr() == last.grad.data_ptr()
    # A bucket moved once for a tensor kept on its memory stays put once nothing is kept.
    model = torch.nn.Linear(4, 2)
    ddp = BucketDataParallel(model)
    kept: torch.Tensor | None = None
    storage_ptrs = []
    for step in range(4):
        ddp(torch.randn(3, 4)).sum().backward()
        kept = model.weight.grad.detach() if step == 0 else None
        model.zero_grad(set_to_none=True)
        storage_ptrs.append(ddp.reducer.buckets[-1].storage.data_ptr())
    out["moves"] = [a != b for a, b in itertools.pairwise(storage_ptrs)]
    del kept
    return out


def test_gradients_kept_past_the_next_backward_stay_intact_as_with_torch_ddp() -> None:
    # Before, with bucket views, the next backward wrote into the kept .grad (the weights
    # ended 0.059 from torch DDP's in a Lightning PCGrad-style module).
    for r in run_ranks(_kept_gradients, 2, timeout=60):
        assert r["torch"][0] == r["copies"][0] == r["views"][0] == [True] * 3
        assert r["views, detached"][0] == [True] * 3
        assert r["torch in backward"] and r["views in backward"]
        assert r["moves"] == [True, False, False]
        for name in ("copies", "views", "views, detached"):
            for ours, theirs in zip(r[name][1], r["torch"][1], strict=True):
                torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
