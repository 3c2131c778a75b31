"""The last bucket, staged at the end of the backward (``reducer/deferred.py``).

From the second step on, the last bucket's members have no hook but the first. These
tests check, on real gloo groups, what the hooks gave before: torch DDP's weights with
and without ``set_to_none``, a parameter that stops getting gradients named on every rank
in that step, ``create_graph`` refused by name, and a hook of the user's that sees the
reduced gradient in ``.grad``, as with torch DDP.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from multirank import raised, run_ranks

STEPS = 5


class Gated(nn.Module):
    """Eleven layers in one bucket; ``skip`` leaves out ``middle``. ``wide.weight`` is
    larger than ``deferred.LARGEST``; ``depth=0`` leaves three layers, too few to defer."""

    def __init__(self, depth: int = 7) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.middle = nn.Linear(8, 8)
        self.tail = nn.Sequential(*(nn.Linear(8, 8) for _ in range(depth)))
        width = 2100 if depth else 8
        self.wide = nn.Linear(8, width) if depth else nn.Identity()
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        if not skip:
            h = torch.relu(self.middle(h))
        return self.head(torch.relu(self.wide(self.tail(h))))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _deferred_names(wrapped: BucketDataParallel) -> list[str]:
    d = wrapped.reducer.deferred
    return [] if d is None else [wrapped.reducer.names[i] for i in d.members]


def _train(rank: int, world: int, set_to_none: bool, accumulate: int) -> dict[str, Any]:
    out: dict[str, Any] = {"deferred": []}
    for name, wrap in (("ours", BucketDataParallel), ("torch", DDP), ("few", BucketDataParallel)):
        torch.manual_seed(0)
        model = Gated(depth=0 if name == "few" else 7)
        wrapped = wrap(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        for step in range(STEPS):
            for micro in range(accumulate):
                x, y = _batch(step * accumulate + micro, rank)
                if micro < accumulate - 1:
                    with wrapped.no_sync():
                        F.mse_loss(wrapped(x), y).backward()
                else:
                    F.mse_loss(wrapped(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            if name != "torch":
                out["deferred"].append(_deferred_names(wrapped))
        out[name] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.parametrize(
    ("set_to_none", "accumulate"),
    [(True, 1), (False, 1), (True, 2)],
    ids=["none", "zeroed", "no_sync"],
)
def test_the_last_bucket_staged_at_the_end_gives_torch_ddps_weights(
    set_to_none: bool, accumulate: int
) -> None:
    for r in run_ranks(_train, 2, set_to_none, accumulate, timeout=60):
        for ours, theirs in zip(r["ours"], r["torch"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        # Deferred from the second step: all but the first to be ready (head.bias) and the
        # one too large (wide.weight).
        first = r["deferred"][0]
        assert len(first) == 20 and "wide.bias" in first, first
        assert "head.bias" not in first and "wide.weight" not in first, first
        if set_to_none:
            assert r["deferred"][:STEPS] == [first] * STEPS
        else:
            # A zeroed .grad is its slot, which cannot tell: hooks again from the third step.
            assert r["deferred"][:STEPS] == [first] + [[]] * (STEPS - 1)
        # Three layers: too few members to defer, every hook stays.
        assert r["deferred"][STEPS:] == [[]] * STEPS


def _step(wrapped: BucketDataParallel, x: torch.Tensor, y: torch.Tensor, skip: bool) -> None:
    F.mse_loss(wrapped(x, skip=skip), y).backward()


def _unused_later(rank: int, world: int, set_to_none: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Gated()
    wrapped = BucketDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    deferred = []
    for step in range(STEPS):
        deferred.append(_deferred_names(wrapped))
        x, y = _batch(step, rank)
        skip = step == 3 and rank == 1  # "middle" gets no gradient on rank 1 at step 3
        message = raised(partial(_step, wrapped, x, y, skip))
        if message != "nothing raised":
            return {"step": step, "message": message, "deferred": deferred}
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return {"step": None, "deferred": deferred}


@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zeroed"])
def test_a_deferred_parameter_with_no_gradient_is_named_on_every_rank(set_to_none: bool) -> None:
    for r in run_ranks(_unused_later, 2, set_to_none, timeout=60):
        assert r["step"] == 3, r
        assert "'middle.weight'" in r["message"] and "'middle.bias'" in r["message"]
        assert "find_unused_parameters=True" in r["message"]
        if set_to_none:  # it was deferred in that step (not so once a .grad was zeroed)
            assert "middle.weight" in r["deferred"][3]


def _create_graph_later(rank: int, world: int) -> tuple[list[str], str]:
    torch.manual_seed(0)
    model = Gated()
    wrapped = BucketDataParallel(model)
    for step in range(2):
        x, y = _batch(step, rank)
        F.mse_loss(wrapped(x), y).backward()
        model.zero_grad()
    deferred = _deferred_names(wrapped)
    x, y = _batch(2, rank)
    return deferred, raised(lambda: F.mse_loss(wrapped(x), y).backward(create_graph=True))


def test_create_graph_is_refused_by_name_in_a_deferred_bucket() -> None:
    for deferred, message in run_ranks(_create_graph_later, 2, timeout=60):
        assert deferred, "nothing deferred"
        assert "has a gradient that requires grad: backward(create_graph=True)" in message


def _hook_added_later(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, wrap in (("ours", BucketDataParallel), ("torch", DDP)):
        torch.manual_seed(0)
        model = Gated()
        wrapped = wrap(model)
        taken: list[torch.Tensor] = []
        for step in range(4):
            if step == 2:  # the stem is deferred by now: the hook gives it its own back
                if name == "ours":
                    out["deferred before"] = "stem.weight" in _deferred_names(wrapped)
                model.stem.weight.register_post_accumulate_grad_hook(
                    lambda p, taken=taken: taken.append(p.grad.detach())
                )
            x, y = _batch(step, rank)
            F.mse_loss(wrapped(x), y).backward()
            if step < 3:
                model.zero_grad(set_to_none=True)
        if name == "ours":
            out["deferred after"] = "stem.weight" in _deferred_names(wrapped)
        grad = model.stem.weight.grad
        out[name] = (taken[-1].data_ptr() == grad.data_ptr(), grad.clone())
    return out


def test_a_hook_added_on_a_deferred_parameter_sees_the_reduced_gradient() -> None:
    for r in run_ranks(_hook_added_later, 2, timeout=60):
        assert r["deferred before"] and not r["deferred after"]
        assert r["ours"][0] and r["torch"][0]  # the hook's tensor is the reduced .grad
        torch.testing.assert_close(r["ours"][1], r["torch"][1], rtol=0, atol=1e-6)
