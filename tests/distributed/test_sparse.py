"""Sparse gradients (embeddings with sparse=True) against torch DDP and one process, on gloo."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from models import assert_weights, batch, build, train, train_global
from multirank import raised, run_ranks

TINY = {"bucket_cap_mb": 0.00001, "first_bucket_mb": 0.00001}  # one per parameter


def _emb_on_rank_0_and_on_even_steps(rank: int, step: int) -> bool:
    # Each embedding is unused on some rank at some step, and the bag is unused everywhere
    # on even steps: its .grad must stay None then (no momentum update).
    return rank == 0 or step % 2 == 0


CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "tiny_buckets": {"ours": TINY},
    "no_view": {"ours": {"gradient_as_bucket_view": False}},
    "no_sync_accumulation": {"train": {"accumulate": 2}},
    "grads_kept": {"train": {"set_to_none": False}},
    "only_sparse": {"name": "sparse_only"},
    "three_ranks": {"world": 3},
}


def _against_ddp(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    name = case.get("name", "sparse")
    opts = case.get("ours", {})
    ours = train(name, lambda m: BucketDataParallel(m, **opts), rank, **case.get("train", {}))
    theirs = train(name, DDP, rank, **case.get("train", {}))
    return {
        "ours": ours["params"],
        "theirs": theirs["params"],
        "buckets": len(ours["wrapped"].bucket_plan),
        "stats": ours["wrapped"].comm_stats,
    }


@pytest.mark.parametrize("case", CASES)
def test_sparse_gradients_give_the_weights_of_torch_ddp(case: str) -> None:
    spec = CASES[case]
    results = run_ranks(_against_ddp, spec.get("world", 2), spec, timeout=90)
    sparse = 1 if spec.get("name") == "sparse_only" else 2
    for rank, r in enumerate(results):
        assert_weights(r["ours"], r["theirs"], rank)
        # One all-reduce per dense bucket (or, with none, for the flags) and per sparse one.
        assert r["stats"].collectives == max(r["buckets"], 1) + sparse
        if case == "tiny_buckets":
            assert r["buckets"] > 2
    # Training moved the embeddings (the gradients were not lost).
    assert not torch.equal(results[0]["ours"]["bag.weight"], build("sparse")._modules["bag"].weight)


def _find_unused(
    rank: int, world: int, steps: list[int], join: bool, set_to_none: bool
) -> dict[str, torch.Tensor]:
    def wrap(m: torch.nn.Module) -> BucketDataParallel:
        return BucketDataParallel(m, find_unused_parameters=True)

    return train(
        "sparse",
        wrap,
        rank,
        steps=steps,
        set_to_none=set_to_none,
        branch=_emb_on_rank_0_and_on_even_steps,
        join={} if join else None,
    )["params"]


# torch DDP is no ground truth here: it raises "Expected sparse gradient to be defined" on
# the rank where an embedding got no gradient. With set_to_none=False, an embedding unused
# here keeps a zeroed .grad, and must still take the others' average.
@pytest.mark.parametrize(
    ("steps", "join", "set_to_none"),
    [([4, 4], False, True), ([4, 4], False, False), ([4, 2], True, True)],
)
def test_sparse_gradients_with_unused_parameters_and_uneven_inputs(
    steps: list[int], join: bool, set_to_none: bool
) -> None:
    want = train_global(
        "sparse", steps, branch=_emb_on_rank_0_and_on_even_steps, set_to_none=set_to_none
    )
    results = run_ranks(_find_unused, 2, steps, join, set_to_none, timeout=90)
    for rank, got in enumerate(results):
        assert_weights(got, want, rank)


def _errors(rank: int, world: int) -> dict[str, str]:
    x, y = batch("sparse", 0, rank)
    model = BucketDataParallel(build("sparse"))
    said = {"hook": raised(lambda: model.register_comm_hook(None, default_hooks.allreduce_hook))}
    # Rank 1 leaves the embedding unused, without find_unused_parameters.
    said["unused"] = raised(lambda: F.mse_loss(model(x, use_left=rank == 0), y).backward())

    late = build("sparse")  # frozen when wrapped, unfrozen after
    late.emb.weight.requires_grad_(False)
    unfrozen = BucketDataParallel(late)
    late.emb.weight.requires_grad_(True)
    said["unfrozen"] = raised(lambda: F.mse_loss(unfrozen(x), y).backward())

    bag = torch.nn.EmbeddingBag(20, 4)  # made sparse after wrapping
    made_sparse = BucketDataParallel(torch.nn.Sequential(bag))
    bag.sparse = True
    said["made_sparse"] = raised(lambda: F.mse_loss(made_sparse(x), y).backward())
    return said


def test_sparse_misuse_is_named_on_every_rank() -> None:
    for said in run_ranks(_errors, 2, timeout=60):
        assert "parameters emb.weight, bag.weight have sparse gradients" in said["hook"]
        assert "parameters ['emb.weight', 'bag.weight'] received no gradient" in said["unused"]
        assert "emb.weight have sparse gradients and became trainable" in said["unfrozen"]
        assert "'0.weight' has a torch.sparse_coo gradient" in said["made_sparse"]
