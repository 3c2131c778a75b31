"""Changes to the wrapped module after wrapping, on real gloo process groups.

A Parameter object added after wrapping has no gradient hook, so its gradient would never
be averaged. bucketddp raises on every rank at the next synced backward instead. (torch
DDP, depending on the case, trains on with each rank on its own gradient, or fails one
step later with "Expected to have finished reduction in the prior iteration".) Changes
that add no Parameter object must not be mistaken for one: those runs must equal one
process training on the global batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from torch import nn

from bucketddp import BucketDataParallel
from models import batch, build
from multirank import run_ranks


def _replace_head(model: nn.Module) -> None:
    model.net[4] = nn.Linear(32, 4)


def _assign_state(model: nn.Module) -> None:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)


def _add_layer(model: nn.Module) -> None:
    model.extra = nn.Linear(4, 4)


def _weight_norm(model: nn.Module) -> None:
    # Replaces net.4.weight by two new Parameters, the magnitude and the direction.
    torch.nn.utils.parametrizations.weight_norm(model.net[4])


CHANGES: dict[str, Callable[[nn.Module], None]] = {
    "replace_head": _replace_head,
    "load_state_dict_assign": _assign_state,
    "add_layer": _add_layer,
    "weight_norm": _weight_norm,
}


def _change_then_train(
    rank: int, world: int, change: str, ranks: tuple[int, ...], opts: dict[str, Any]
) -> dict[str, Any]:
    model = build("mlp")
    wrapped = BucketDataParallel(model, **opts)
    outcome: dict[str, Any] = {"errors": []}
    for step in range(3):
        if step == 1 and rank in ranks:
            CHANGES[change](model)
        x, y = batch("mlp", step, rank)
        out = wrapped(x)
        if hasattr(model, "extra"):
            out = model.extra(out)
        try:
            F.mse_loss(out, y).backward()
        except RuntimeError as e:
            outcome["errors"].append((step, str(e)))
        model.zero_grad()
    return outcome


@pytest.mark.parametrize("find_unused", [False, True])
@pytest.mark.parametrize("change", list(CHANGES))
def test_new_parameters_raise_on_every_rank(change: str, find_unused: bool) -> None:
    opts = {"find_unused_parameters": find_unused}
    results = run_ranks(_change_then_train, 2, change, (0, 1), opts, timeout=60)
    for r in results:
        steps = [step for step, _ in r["errors"]]
        assert steps == [1, 2], r["errors"]  # from the first backward after the change on
        message = r["errors"][0][1]
        assert "gained parameters after wrapping, on 2 of 2 ranks" in message
        assert "wrap the module again" in message
        if change == "replace_head":
            assert "replaced net.4.weight, net.4.bias)" in message
        elif change == "add_layer":
            assert "added extra.weight, extra.bias)" in message
        elif change == "weight_norm":
            assert (
                "added net.4.parametrizations.weight.original0, "
                "net.4.parametrizations.weight.original1; removed net.4.weight)"
            ) in message
        else:
            assert "replaced net.0.weight, net.0.bias, net.2.weight" in message


def test_change_on_one_rank_raises_on_every_rank() -> None:
    results = run_ranks(_change_then_train, 2, "replace_head", (1,), {}, timeout=60)
    unchanged, changed = (r["errors"][0][1] for r in results)
    assert "on 1 of 2 ranks (none on this rank)" in unchanged
    assert "on 1 of 2 ranks (here: replaced net.4.weight, net.4.bias)" in changed


def test_world_size_1_raises_too() -> None:
    (result,) = run_ranks(_change_then_train, 1, "replace_head", (0,), {}, timeout=60)
    assert [step for step, _ in result["errors"]] == [1, 2]
    assert "on 1 of 1 ranks (here: replaced net.4.weight" in result["errors"][0][1]


def _convert_dtype(rank: int, world: int, set_to_none: bool) -> list[str]:
    model = build("mlp")
    wrapped = BucketDataParallel(model)
    errors = []
    for step in range(2):
        x, y = batch("mlp", step, rank)
        if step == 1:
            # With gradients kept (set_to_none=False), .double() converts them too, setting
            # .data of each: the bucket views then hold memory outside their buckets.
            model.double()
            x, y = x.double(), y.double()
        try:
            F.mse_loss(wrapped(x), y).backward()
        except RuntimeError as e:
            errors.append(str(e))
        model.zero_grad(set_to_none=set_to_none)
    return errors


@pytest.mark.parametrize("set_to_none", [True, False])
def test_dtype_conversion_after_wrapping_is_named(set_to_none: bool) -> None:
    for errors in run_ranks(_convert_dtype, 2, set_to_none, timeout=60):
        assert len(errors) == 1
        assert "now has a torch.float64 gradient, but it was torch.float32" in errors[0]
        assert "before wrapping it" in errors[0]


def _rank_or_global_batch(name: str, step: int, rank: int, world: int) -> Any:
    """Rank ``rank``'s batch; with ``world`` 0, the global batch of two ranks."""
    if world:
        return batch(name, step, rank)
    return (torch.cat(t) for t in zip(batch(name, step, 0), batch(name, step, 1), strict=True))


def _channels_last_midway(rank: int, world: int, set_to_none: bool) -> dict[str, torch.Tensor]:
    """Four steps of the conv net, turned channels_last after step 1's backward, while
    its gradients exist; world 0 means one process on the global batch (the ground truth)."""
    model = build("conv")
    model.features[1] = nn.Identity()  # no BatchNorm: a rank's statistics are not global
    wrapped = BucketDataParallel(model) if world else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        x, y = _rank_or_global_batch("conv", step, rank, world)
        F.mse_loss(wrapped(x), y).backward()
        if step == 1:
            model.to(memory_format=torch.channels_last)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    assert not model.features[0].weight.is_contiguous()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_memory_format_change_after_wrapping_keeps_training_right(set_to_none: bool) -> None:
    # Before, with bucket views, the conversion moved the gradients out of their buckets:
    # the ranks then stepped on stale averages plus their own gradient (2.8e-2 apart).
    truth = _channels_last_midway(0, 0, set_to_none)
    for ours in run_ranks(_channels_last_midway, 2, set_to_none, timeout=60):
        for name, want in truth.items():
            torch.testing.assert_close(ours[name], want, rtol=0, atol=1e-6, msg=name)


def _ema_attached(rank: int, world: int, unfreeze_at: int | None) -> dict[str, Any]:
    """A frozen copy of the network attached after wrapping and updated as an EMA after
    each step; ``unfreeze_at`` makes it trainable at that step. World 0: one process on
    the global batch (the ground truth)."""
    model = build("mlp")
    wrapped = BucketDataParallel(model) if world else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    errors = []
    for step in range(4):
        if step == 1:
            model.ema = copy.deepcopy(model.net).requires_grad_(False)
        if step == unfreeze_at:
            model.ema.requires_grad_(True)
        x, y = _rank_or_global_batch("mlp", step, rank, world)
        try:
            F.mse_loss(wrapped(x), y).backward()
        except RuntimeError as e:
            errors.append((step, str(e)))
        opt.step()
        opt.zero_grad()
        if step >= 1:
            with torch.no_grad():
                for e, p in zip(model.ema.parameters(), model.net.parameters(), strict=True):
                    e.lerp_(p, 0.5)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "errors": errors}


def test_frozen_parameters_added_after_wrapping_are_no_change_until_unfrozen() -> None:
    # Before, an EMA copy attached after wrapping (in on_fit_start, say) raised "gained
    # parameters" on every rank, though it never gets a gradient; torch DDP trains on.
    truth = _ema_attached(0, 0, None)["params"]
    assert "ema.0.weight" in truth
    for ours in run_ranks(_ema_attached, 2, None, timeout=60):
        assert ours["errors"] == []
        for name, want in truth.items():
            torch.testing.assert_close(ours["params"][name], want, rtol=0, atol=1e-6, msg=name)
    # Unfrozen, it could train on each rank's own gradient: it counts from then on.
    for ours in run_ranks(_ema_attached, 2, 2, timeout=60):
        assert [step for step, _ in ours["errors"]] == [2, 3]
        assert "on 2 of 2 ranks (here: added ema.0.weight" in ours["errors"][0][1]


# ---------------------------------------------------- changes that add no parameter
class _Twice(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def _harmless_changes(model: nn.Module) -> None:
    nn.Linear(3, 3)  # an unrelated module: parameters registered elsewhere
    model.net[1] = nn.ReLU()  # a new submodule without parameters
    model.load_state_dict(model.state_dict())  # copies in place
    # Moves net.2.weight to net.2.parametrizations.weight.original: the same Parameter.
    parametrize.register_parametrization(model.net[2], "weight", _Twice())


def _train_with_changes(rank: int, world: int, remove: bool) -> dict[str, torch.Tensor]:
    """Four steps with the harmless changes before step 2; world 0 means one process
    training on the global batch of two ranks (the ground truth). ``remove`` also drops a
    parameter, which find_unused_parameters=True allows."""
    model = build("mlp")
    wrapped = BucketDataParallel(model, find_unused_parameters=remove) if world else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        if step == 2:
            _harmless_changes(model)
            if remove:
                model.net[4].bias = None
        x, y = _rank_or_global_batch("mlp", step, rank, world)
        F.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("remove", [False, True])
def test_changes_that_add_no_parameter_still_match_one_process(remove: bool) -> None:
    # torch DDP is no ground truth here: after register_parametrization it stops reducing
    # net.2's weight ("Expected to have finished reduction in the prior iteration").
    truth = _train_with_changes(0, 0, remove)
    assert "net.2.parametrizations.weight.original" in truth
    assert ("net.4.bias" in truth) is not remove
    for ours in run_ranks(_train_with_changes, 2, remove, timeout=60):
        assert ours.keys() == truth.keys()
        for name, want in truth.items():
            torch.testing.assert_close(ours[name], want, rtol=0, atol=1e-6, msg=name)
