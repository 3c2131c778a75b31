"""Differences from torch DDP that torch's own DDP tests found, each against torch DDP.

Distributed autograd is refused on every rank (torch DDP averages it), whether the forward
runs inside its context or only the backward does; a parameter the
graph reached without a gradient keeps ``.grad`` None, as with torch DDP; the
``forward_sync_buffers`` attribute; a ``process_group`` that leaves this rank out.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from multirank import free_port, raised, run_ranks

DDP_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(DDP).parameters
"""torch DDP's forward_sync_buffers came in torch 2.13: compared with ours from there on."""
FORWARD_SYNC_CASES: tuple[dict[str, bool], ...] = (
    {},
    {"forward_sync_buffers": True},
    {"forward_sync_buffers": False},
)


def _dist_autograd(rank: int, world: int, port: int) -> dict[str, Any]:
    """Distributed autograd with the forward inside its context, and with the backward alone
    inside it; then a plain step outside any context."""
    import contextlib
    import io

    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    out: dict[str, Any] = {}
    try:
        for name, wrap in (("ddp", DDP), ("ours", BucketDataParallel)):
            torch.manual_seed(0)
            model = wrap(nn.Linear(3, 2))
            for forward_inside in (True, False):
                stderr = io.StringIO()
                loss = None if forward_inside else model(torch.full((1, 3), rank + 1.0)).sum()
                with dist_autograd.context() as ctx, contextlib.redirect_stderr(stderr):
                    try:
                        if loss is None:
                            loss = model(torch.full((1, 3), rank + 1.0)).sum()
                        dist_autograd.backward(ctx, [loss])
                        grad = dist_autograd.get_gradients(ctx)[model.module.weight].clone()
                    except (NotImplementedError, RuntimeError) as err:
                        grad = f"{err} / {stderr.getvalue()}"
                out[name, "forward inside" if forward_inside else "backward only"] = grad
            # Outside a context the wrapper trains as usual.
            model(torch.ones(1, 3)).sum().backward()
            out[name, "plain"] = model.module.weight.grad.clone()
    finally:
        rpc.shutdown()
    return out


@pytest.fixture(scope="module")
def dist_autograd_runs() -> list[dict[str, Any]]:
    return run_ranks(_dist_autograd, 2, free_port(), timeout=90)


@pytest.mark.parametrize("case", ["forward inside", "backward only"])
def test_distributed_autograd_is_refused_on_every_rank_where_torch_ddp_averages(
    dist_autograd_runs: list[dict[str, Any]], case: str
) -> None:
    # The forward inside dist_autograd.context(), or only dist_autograd.backward(ctx, [loss]).
    for r in dist_autograd_runs:
        # torch DDP: the mean of the ranks' gradients (inputs 1 and 2).
        torch.testing.assert_close(r["ddp", case], torch.full((2, 3), 1.5))
        # Never each rank's own gradient (1.0 or 2.0) in silence: an error on every rank.
        ours = r["ours", case]
        assert isinstance(ours, str), f"kept a gradient: {ours}"
        assert "does not reduce gradients computed with torch.distributed.autograd" in ours
        assert "torch.nn.parallel.DistributedDataParallel" in ours
        if case == "backward only":
            assert "dist_autograd.backward() runs through this wrapper's output" in ours
        torch.testing.assert_close(r["ours", "plain"], r["ddp", "plain"])


class _NoGradFor(torch.autograd.Function):
    """``x * w.sum()``, whose backward gives ``w`` no gradient where ``drop`` is set."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, drop: bool) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.drop = drop
        return x * w.sum()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        w_grad = None if ctx.drop else (g * x).sum().expand(3)
        return g, w_grad, None


class _Gated(nn.Module):
    def __init__(self, drop: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.ones(3))
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NoGradFor.apply(self.lin(x), self.w, self.drop)


def _grads_and_attributes(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # A parameter the graph reaches without a gradient: on no rank, or on rank 0 only.
    for case, drop in (("nowhere", True), ("rank0", rank == 0)):
        for as_view in (True, False):
            for name, wrap in (("ddp", DDP), ("ours", BucketDataParallel)):
                model = wrap(
                    _Gated(drop), find_unused_parameters=True, gradient_as_bucket_view=as_view
                )
                for step in range(2):
                    model(torch.full((2, 4), rank + step + 1.0)).sum().backward()
                grads = {n: p.grad for n, p in model.module.named_parameters()}
                out[(case, as_view, name)] = {
                    n: None if g is None else g.clone() for n, g in grads.items()
                }
    # forward_sync_buffers (and broadcast_buffers, its older name), read and set.
    for kwargs in FORWARD_SYNC_CASES if DDP_HAS_FORWARD_SYNC else ():
        for name, wrap in (("ddp", DDP), ("ours", BucketDataParallel)):
            model = wrap(nn.BatchNorm1d(2), **kwargs)
            key = ("fsb", str(kwargs), name)
            out[key] = [model.forward_sync_buffers, model.broadcast_buffers]
            model.forward_sync_buffers = False  # then a rank-dependent batch: apart
            model(torch.randn(4, 2) + rank)
            model(torch.randn(4, 2))
            out[key].append(model.module.running_mean.clone())
    local = BucketDataParallel(nn.BatchNorm1d(2), forward_sync_buffers=False)
    out["switch_on"] = raised(lambda: setattr(local, "forward_sync_buffers", True), ValueError)
    return out


def test_parameter_without_gradient_and_forward_sync_buffers_match_torch_ddp() -> None:
    results = run_ranks(_grads_and_attributes, 2, timeout=90)
    for rank, r in enumerate(results):
        for case in ("nowhere", "rank0"):
            for as_view in (True, False):
                ours, theirs = r[(case, as_view, "ours")], r[(case, as_view, "ddp")]
                assert (ours["w"] is None) == (theirs["w"] is None) == (case == "nowhere")
                for n, g in theirs.items():
                    if g is not None:
                        torch.testing.assert_close(ours[n], g, msg=f"{case} {n} rank {rank}")
        assert "cannot be switched on after wrapping" in r["switch_on"]
        for kwargs in FORWARD_SYNC_CASES if DDP_HAS_FORWARD_SYNC else ():
            key = str(kwargs)
            assert r[("fsb", key, "ours")][:2] == r[("fsb", key, "ddp")][:2], kwargs
    # Set to False, the buffers stay each rank's own, as with torch DDP.
    for name in ("ours", "ddp") if DDP_HAS_FORWARD_SYNC else ():
        means = [r[("fsb", "{}", name)][-1] for r in results]
        assert not torch.allclose(means[0], means[1])


def _outside_group(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group([0, 1])
    if rank == 2:
        return {
            "error": raised(
                lambda: BucketDataParallel(nn.Linear(2, 2), process_group=group), ValueError
            )
        }
    grads = {}
    for name, wrap in (("ddp", DDP), ("ours", BucketDataParallel)):
        torch.manual_seed(0)
        model = wrap(nn.Linear(2, 2), process_group=group)
        model(torch.full((1, 2), rank + 1.0)).sum().backward()
        grads[name] = model.module.weight.grad.clone()
    return grads


def test_a_process_group_without_this_rank_is_named_on_that_rank() -> None:
    results = run_ranks(_outside_group, 3, timeout=90)
    for r in results[:2]:
        torch.testing.assert_close(r["ours"], r["ddp"])
    error = results[2]["error"]
    assert "this rank (global rank 2) is not a member of process_group" in error
    assert "int -100" not in error and "dist.get_rank() in ranks" in error
