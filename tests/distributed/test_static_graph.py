"""static_graph=True against torch DDP with the same option, on gloo."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from models import assert_weights, batch, build, train, train_global
from multirank import raised, run_ranks

TINY = {"bucket_cap_mb": 0.002, "first_bucket_mb": 0.0005}


def _left_always(rank: int, step: int) -> bool:
    return True


CASES: dict[str, dict[str, Any]] = {
    # One layer in two reentrant checkpoint segments: two gradients per backward.
    "shared_segments": {"name": "shared_segments"},
    "shared_segments_tiny_buckets": {"name": "shared_segments", "ours": TINY},
    "shared_segments_no_view": {
        "name": "shared_segments",
        "ours": {"gradient_as_bucket_view": False},
    },
    "shared_segments_grads_kept": {"name": "shared_segments", "train": {"set_to_none": False}},
    "shared_segments_three_ranks": {"name": "shared_segments", "world": 3},
    # Branches no rank takes, without find_unused_parameters: their weights stay put.
    "unused_branches": {"name": "branchy", "train": {"branch": _left_always}},
    "mlp": {"name": "mlp", "ours": TINY},
}


def _against_ddp(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    name, opts, loop = case["name"], case.get("ours", {}), case.get("train", {})
    ours = train(name, lambda m: BucketDataParallel(m, static_graph=True, **opts), rank, **loop)
    theirs = train(name, lambda m: DDP(m, static_graph=True), rank, **loop)
    return {"ours": ours["params"], "theirs": theirs["params"]}


@pytest.mark.parametrize("case", CASES)
def test_static_graph_gives_the_weights_of_torch_ddp(case: str) -> None:
    spec = CASES[case]
    results = run_ranks(_against_ddp, spec.get("world", 2), spec, timeout=90)
    initial = dict(build(spec["name"]).named_parameters())
    for rank, r in enumerate(results):
        assert_weights(r["ours"], r["theirs"], rank)
    moved = {n for n, p in results[0]["ours"].items() if not torch.equal(p, initial[n])}
    if case == "unused_branches":
        assert moved == set(initial) - {"right.weight", "right.bias", "never.weight", "never.bias"}
    else:
        assert moved == set(initial)


def _no_sync(rank: int, world: int) -> dict[str, torch.Tensor]:
    def wrap(m: torch.nn.Module) -> BucketDataParallel:
        return BucketDataParallel(m, static_graph=True)

    return train("shared_segments", wrap, rank, accumulate=2)["params"]


def test_static_graph_accumulates_through_no_sync_like_the_global_batch() -> None:
    # torch DDP fails an internal assert with static_graph and no_sync, even on the MLP
    # (expect_autograd_hooks_, reducer.cpp), so the ground truth is one process.
    want = train_global("shared_segments", [4, 4], accumulate=2)
    for rank, got in enumerate(run_ranks(_no_sync, 2, timeout=60)):
        assert_weights(got, want, rank)


def _fewer_gradients(rank: int, world: int, segments: list[int]) -> dict[str, torch.Tensor]:
    """SGD steps with ``segments[step]`` reentrant segments; on one rank, the global batch."""
    net = build("shared_segments")
    model: torch.nn.Module = BucketDataParallel(net, static_graph=True) if world > 1 else net
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step, count in enumerate(segments):
        net.segments = count
        for r in [rank] if world > 1 else [0, 1]:
            x, y = batch("shared_segments", step, r)
            (F.mse_loss(model(x), y) / (1 if world > 1 else 2)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def test_fewer_gradients_than_counted_are_reduced_at_the_end() -> None:
    segments = [2, 1, 0, 2]  # net.2 gets 2, then 1, then none, then 2 gradients
    (want,) = run_ranks(_fewer_gradients, 1, segments, timeout=60)
    for rank, got in enumerate(run_ranks(_fewer_gradients, 2, segments, timeout=60)):
        assert_weights(got, want, rank)


def _errors(rank: int, world: int) -> dict[str, str]:
    x, y = batch("shared_segments", 0, rank)
    model = BucketDataParallel(build("shared_segments"))
    said = {"dynamic": raised(lambda: F.mse_loss(model(x), y).backward())}

    net = build("shared_segments")
    static = BucketDataParallel(net, static_graph=True)
    F.mse_loss(static(x), y).backward()
    net.segments = 3  # the graph changes
    said["changed"] = raised(lambda: F.mse_loss(static(x), y).backward())
    return said


def test_a_parameter_with_several_gradients_is_named_on_every_rank() -> None:
    for said in run_ranks(_errors, 2, timeout=60):
        assert "'net.2.bias' received a gradient twice in one backward" in said["dynamic"]
        assert "or static_graph=True to the wrapper" in said["dynamic"]
        assert "'net.2.bias' received 3 gradients in this backward pass, but 2" in said["changed"]
