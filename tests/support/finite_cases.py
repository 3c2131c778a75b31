"""check_finite=True cases shared by tests/distributed/test_finite.py and the CUDA tests.

A rank's gradient is poisoned by adding ``p.sum() * nan`` to its loss, which gives that
parameter, and no other, a NaN (or Inf) gradient. The ground truth after the error is torch
DDP on the same batches with the bad step skipped: the user catches the error, zeroes the
gradients and goes on, and the wrapper must train as if that step had never run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from engine_cases import TINY
from models import assert_weights, batch, build

STEPS, BAD = 4, 2  # the step whose gradients are poisoned
BAD_PARAMS = {1: {"net.2.weight": float("nan")}}  # by rank: parameter -> poison

CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "comm_hook": {"hook": default_hooks.allreduce_hook},
    "no_sync": {"accumulate": 2},  # poisoned in the first micro-batch, inside no_sync()
    "unused": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "copies": {"gradient_as_bucket_view": False},
    "fused": {"fused": True},  # the accelerators' way: one norm kernel per bucket
    "rows": {"rows": 2},  # the row area split in two rows, as past 256 ranks in bfloat16
}


@contextlib.contextmanager
def _forced(fused: bool, rows: int | None) -> Iterator[None]:
    """In this process, for a while: the fused check on the CPU, ``rows`` rows of flags."""
    from bucketddp.reducer import agreement, finite

    saved = finite.ON_HOST, agreement.row_count
    if fused:
        finite.ON_HOST = frozenset()
    if rows is not None:
        agreement.row_count = lambda dtype, world_size: rows  # type: ignore[assignment]
    try:
        yield
    finally:
        finite.ON_HOST, agreement.row_count = saved


def poisoned_loss(
    model: nn.Module, wrapped: nn.Module, step: int, rank: int, poison: dict[str, float]
) -> torch.Tensor:
    x, y = (t.to(next(model.parameters()).device) for t in batch("mlp", step, rank))
    loss = F.mse_loss(wrapped(x), y)
    params = dict(model.named_parameters())
    # An added p.sum() * nan gives p (and no other parameter) a NaN gradient.
    return sum((params[n].sum() * v for n, v in poison.items()), loss)


def train_poisoned(
    model: nn.Module,
    wrapped: nn.Module,
    rank: int,
    *,
    accumulate: int = 1,
    poison: dict[int, dict[str, float]] | None = None,
) -> list[str]:
    """STEPS steps; at BAD, rank r's gradients get ``poison[r]``, or the step is skipped
    (``poison`` None). Returns the errors caught, the step skipped after each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    errors = []
    for step in range(STEPS):
        if step == BAD and poison is None:
            continue
        mine = poison.get(rank, {}) if poison is not None and step == BAD else {}
        try:
            for micro in range(accumulate):
                last = micro == accumulate - 1
                with contextlib.nullcontext() if last else wrapped.no_sync():  # type: ignore[operator]
                    dose = mine if micro == 0 else {}
                    poisoned_loss(model, wrapped, step * accumulate + micro, rank, dose).backward()
        except RuntimeError as e:
            errors.append(str(e))
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    return errors


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters, on the CPU."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def train_configs(rank: int, world: int, names: list[str], device: str = "cpu") -> dict[str, Any]:
    """On each rank: torch DDP skipping step BAD, then each of CONFIGS ``names`` with the
    check on and BAD_PARAMS poisoned at step BAD (a run_ranks function)."""
    out: dict[str, Any] = {}
    for accumulate in sorted({CONFIGS[n].get("accumulate", 1) for n in names}):
        model = build("mlp").to(device)
        train_poisoned(model, DDP(model), rank, accumulate=accumulate)
        out[f"ddp/{accumulate}"] = params_of(model)
    for name in names:
        opts = dict(CONFIGS[name])
        hook, accumulate = opts.pop("hook", None), opts.pop("accumulate", 1)
        with _forced(opts.pop("fused", False), opts.pop("rows", None)):
            model = build("mlp").to(device)
            wrapped = BucketDataParallel(model, check_finite=True, **TINY, **opts)
            if hook is not None:
                wrapped.register_comm_hook(None, hook)
            errors = train_poisoned(model, wrapped, rank, accumulate=accumulate, poison=BAD_PARAMS)
        out[name] = {"errors": errors, "params": params_of(model), "accumulate": accumulate}
    return out


def assert_named_and_recovered(results: list[dict[str, Any]], config: str) -> None:
    """Every rank raised once, naming rank 1 and its parameter, then trained as torch DDP."""
    for rank, r in enumerate(results):
        got = r[config]
        assert len(got["errors"]) == 1, got["errors"]
        message = got["errors"][0]
        assert "on rank 1 in ['net.2.weight'] (check_finite=True)" in message, message
        assert "rank 0" not in message
        # The steps after the error train as torch DDP does without the bad step.
        assert_weights(got["params"], r[f"ddp/{got['accumulate']}"], rank)
