"""Which backward passes the wrapper reduces: torch DDP's contract, checked against it.

The backward after a grad-enabled forward through the wrapper is reduced, with the
``no_sync()`` decision taken at that forward. Gradients from any other graph (the bare
module, another wrapper sharing parameters, the module after its wrapper is gone) stay
local. Each scenario runs the same loop under both wrappers on 2 gloo ranks and compares
every gradient after every backward, and the final weights, to 1e-6.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from bucketddp import BucketDataParallel
from bucketddp.forward_io import hook_outputs
from models import assert_pairs_match, assert_weights
from multirank import raised, run_ranks

Wrap = Callable[..., nn.Module]


class Heads(nn.Module):
    """A shared encoder and two heads: ``nn.Sequential(enc, head)`` is wrapped per head."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(10, 8)
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)


def _data(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(6, 10, generator=g), torch.randn(6, 4, generator=g)


class _Recorder:
    """Trains ``model`` with SGD; keeps every ``.grad`` after every backward, and the weights."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        self.grads: dict[str, torch.Tensor] = {}

    def backward(self, loss: torch.Tensor, tag: str) -> None:
        loss.backward()
        for n, p in self.model.named_parameters():
            if p.grad is not None:
                self.grads[f"{tag} {n}"] = p.grad.detach().clone()

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def result(self) -> dict[str, dict[str, torch.Tensor]]:
        params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        return {"grads": self.grads, "params": params}


def _shared(rank: int, wrap: Wrap, scenario: str) -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    heads = Heads()
    a = wrap(nn.Sequential(heads.enc, heads.a), find_unused_parameters=scenario == "by_step")
    b = wrap(nn.Sequential(heads.enc, heads.b), find_unused_parameters=scenario == "by_step")
    rec = _Recorder(heads)
    for step in range(4):
        x, y = _data(step, 0, rank)
        if scenario == "alternate":  # both heads every step, one backward each
            rec.backward(F.mse_loss(a(x), y), f"{step}a")
            rec.backward(F.mse_loss(b(x), y), f"{step}b")
        else:  # one head per step
            rec.backward(F.mse_loss((a if step % 2 == 0 else b)(x), y), f"{step}")
        rec.step()
    return rec.result()


def _small(wrap: Wrap) -> tuple[nn.Module, nn.Module, _Recorder]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 4))
    return model, wrap(model), _Recorder(model)


def _bare(rank: int, wrap: Wrap, scenario: str) -> dict[str, dict[str, torch.Tensor]]:
    model, wrapped, rec = _small(wrap)
    for step in range(4):
        x, y = _data(step, 0, rank)
        if scenario == "aux_on_rank0":
            # An extra loss through the bare module, on one rank only: local, no collective.
            rec.backward(F.mse_loss(wrapped(x), y), f"{step}")
            if rank == 0:
                rec.backward(model(x).pow(2).mean(), f"{step} aux")
        elif step < 2:
            rec.backward(F.mse_loss(wrapped(x), y), f"{step}")
        else:
            if step == 2:
                # Drop the wrapper: its hooks go with it. Then train the bare module, or wrap
                # it again.
                del wrapped
                gc.collect()
                wrapped = model if scenario == "dropped" else wrap(model)
            rec.backward(F.mse_loss(wrapped(x), y), f"{step}")
        rec.step()
    return rec.result()


def _decided_at_forward(rank: int, wrap: Wrap, scenario: str) -> dict[str, dict[str, torch.Tensor]]:
    _, wrapped, rec = _small(wrap)
    for step in range(2):
        for micro in range(3):
            x, y = _data(step, micro, rank)
            sync = micro == 2
            quiet = contextlib.nullcontext() if sync else wrapped.no_sync()  # type: ignore[operator]
            tag = f"{step}.{micro}"
            if scenario == "flag":  # nanoGPT's way: the attribute, set before the forward
                wrapped.require_backward_grad_sync = sync
                rec.backward(F.mse_loss(wrapped(x), y), tag)
            elif scenario == "forward_inside":
                with quiet:
                    loss = F.mse_loss(wrapped(x), y)
                rec.backward(loss, tag)
            elif scenario == "extra_forward_inside":
                # A synced forward, then an auxiliary one inside no_sync(): still synced.
                with quiet:
                    loss = F.mse_loss(wrapped(x), y)
                with wrapped.no_sync():  # type: ignore[operator]
                    loss = loss + F.mse_loss(wrapped(x.flip(0)), y)
                rec.backward(loss, tag)
            else:  # backward inside only: the forward decided to sync
                loss = F.mse_loss(wrapped(x), y)
                with quiet:
                    rec.backward(loss, tag)
        rec.step()
    return rec.result()


LOOPS = {"shared": _shared, "bare": _bare, "decided_at_forward": _decided_at_forward}


def _compare(rank: int, world: int, loop: str, scenario: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    ours = LOOPS[loop](rank, BucketDataParallel, scenario)
    theirs = LOOPS[loop](rank, DDP, scenario)
    return {k: (ours[k], theirs[k]) for k in ours}


def _run(loop: str, scenario: str) -> list[dict[str, Any]]:
    results = run_ranks(_compare, 2, loop, scenario)
    for r in results:
        ours, theirs = r["grads"]
        assert ours.keys() == theirs.keys(), "a gradient exists under one wrapper only"
    assert_pairs_match(results)
    return results


def _ranks_apart(results: list[dict[str, Any]], key: str) -> float:
    a, b = (r[key][1] for r in results)  # torch DDP's side: the ground truth
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize("scenario", ["alternate", "by_step"])
def test_wrappers_sharing_parameters_reduce_only_their_own_backward(scenario: str) -> None:
    # Before, the other wrapper's hooks acted on the shared encoder too: "alternate" raised
    # the unused-parameter error, "by_step" (find_unused_parameters) trained other weights.
    results = _run("shared", scenario)
    assert _ranks_apart(results, "params") == 0.0


def test_a_loss_through_the_bare_module_stays_local() -> None:
    results = _run("bare", "aux_on_rank0")
    # Rank 0's extra gradient was never reduced, so the ranks drift apart, as with torch DDP
    # (before, it was reduced, and waited for rank 1 in vain).
    assert _ranks_apart(results, "params") > 1e-3


@pytest.mark.parametrize("scenario", ["dropped", "wrapped_again"])
def test_a_dropped_wrapper_takes_its_hooks_along(scenario: str) -> None:
    # Before, the dropped wrapper's hooks stayed on the parameters: the bare module went on
    # reducing, and a new wrapper's gradients were reduced twice (other weights).
    results = _run("bare", scenario)
    apart = _ranks_apart(results, "params")
    assert apart > 1e-3 if scenario == "dropped" else apart == 0.0


@pytest.mark.parametrize(
    "scenario", ["flag", "forward_inside", "extra_forward_inside", "backward_inside"]
)
def test_the_forward_decides_whether_its_backward_syncs(scenario: str) -> None:
    # "extra_forward_inside": before, the forward inside no_sync() took back the decision of
    # the synced one before it, and the ranks stepped on their own gradients.
    results = _run("decided_at_forward", scenario)
    # The micro-batches' gradients stayed local (they differ by rank), the last one's not.
    a, b = (r["grads"][1] for r in results)
    local = scenario != "backward_inside"
    assert (not torch.equal(a["0.0 0.weight"], b["0.0 0.weight"])) is local
    assert torch.equal(a["0.2 0.weight"], b["0.2 0.weight"])


class _Segment(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=True)


class _StepsInside(nn.Module):
    """Runs the backward inside its forward, as Lightning's manual optimization does (the
    forward is the whole ``training_step``); the last layer is a reentrant checkpoint."""

    def __init__(self, pass_loss: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), _Segment())
        self.pass_loss = pass_loss
        self.wrapper: list[BucketDataParallel] = []  # a list: not a submodule

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.net(x), y)
        self.wrapper[0].prepare_for_backward(loss if self.pass_loss else None)
        loss.backward()
        return loss.detach()


def _inside(rank: int, world: int, pass_loss: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = _StepsInside(pass_loss)
    wrapped = BucketDataParallel(model, find_unused_parameters=not pass_loss)
    model.wrapper.append(wrapped)
    wrapped(*_data(0, 0, rank))
    return {n: p.grad.clone() for n, p in model.net.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pass_loss", [True, False])
def test_a_backward_inside_the_forward_is_reduced_whole(pass_loss: bool) -> None:
    # The first gradients come from the checkpoint segment's nested backward. Before, its
    # end disarmed the wrapper and the outer layer's gradients stayed local; with the loss
    # given to prepare_for_backward, the step ends with the outer backward.
    torch.manual_seed(0)
    truth = _StepsInside(pass_loss)
    xs, ys = zip(*(_data(0, 0, r) for r in range(2)), strict=True)
    F.mse_loss(truth.net(torch.cat(xs)), torch.cat(ys)).backward()
    want = {n: p.grad for n, p in truth.net.named_parameters() if p.grad is not None}
    for rank, got in enumerate(run_ranks(_inside, 2, pass_loss)):
        assert got.keys() == want.keys()
        assert_weights(got, want, rank)


def _both_armed(rank: int, world: int, how: str) -> Any:
    torch.manual_seed(0)
    heads = Heads()
    views = how != "summed_copies"
    a = BucketDataParallel(nn.Sequential(heads.enc, heads.a), gradient_as_bucket_view=views)
    b = BucketDataParallel(nn.Sequential(heads.enc, heads.b), gradient_as_bucket_view=views)
    x, y = _data(0, 0, rank)
    loss_a, loss_b = F.mse_loss(a(x), y), F.mse_loss(b(x), y)
    loss = loss_a if how == "one_of_two" else loss_a + loss_b  # b still expects its own
    if views:
        return raised(loss.backward)
    loss.backward()
    return {n: p.grad.clone() for n, p in heads.named_parameters()}


@pytest.mark.parametrize("how", ["summed", "one_of_two"])
def test_two_wrappers_reducing_one_parameter_in_one_backward_raise_on_every_rank(
    how: str,
) -> None:
    # Before, the second wrapper averaged the first one's staged (already averaged)
    # gradient again: the shared encoder trained on half its gradient, without a word.
    for said in run_ranks(_both_armed, 2, how):
        assert "parameter '0.bias' is reduced by two BucketDataParallel wrappers" in said
        assert "wrap one module that holds every part" in said


def test_without_bucket_views_two_wrappers_may_reduce_one_parameter() -> None:
    # Each wrapper stages the local gradient in its own bucket and copies the average back:
    # twice the communication, but the global batch's gradient.
    torch.manual_seed(0)
    heads = Heads()
    for r in range(2):
        x, y = _data(0, 0, r)
        h = heads.enc(x)
        ((F.mse_loss(heads.a(h), y) + F.mse_loss(heads.b(h), y)) / 2).backward()
    want = {n: p.grad for n, p in heads.named_parameters()}
    for rank, got in enumerate(run_ranks(_both_armed, 2, "summed_copies")):
        assert_weights(got, want, rank)


def _leaves(rank: int, world: int) -> tuple[bool, int, int]:
    model = nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    wrapped = BucketDataParallel(model, buffer_sync={"1.num_batches_tracked": "sum"})
    F.mse_loss(wrapped(torch.randn(6, 10)), torch.randn(6, 4)).backward()
    ref = weakref.ref(wrapped)
    del wrapped  # no gc.collect(): the hooks hold the reducer, not the wrapper
    grad_hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return ref() is None, grad_hooks, len(model[1]._load_state_dict_pre_hooks)


def test_a_dropped_wrapper_is_freed_at_once_and_leaves_no_hook() -> None:
    for freed, grad_hooks, load_hooks in run_ranks(_leaves, 2):
        assert freed
        assert grad_hooks == 0
        assert load_hooks == 0


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    extra: list[torch.Tensor]
    note: str = "not a tensor"


def test_output_hooks_reach_into_dataclasses_as_torch_ddp_finds_tensors() -> None:
    # The outputs' hooks open each backward through them (see on_output_grad); torch DDP's
    # _find_tensors walks dataclass fields too. Before, a dataclass output got no hook.
    w = torch.ones(3, requires_grad=True)
    out = _Output(w * 2, [w * 3, w.detach()])
    seen: list[int] = []
    hook_outputs(out, lambda g: seen.append(g.numel()))
    (out.logits.sum() + out.extra[0].sum()).backward()
    assert seen == [3, 3]
