"""Sparse gradients (embeddings with sparse=True) against torch DDP and one process, on gloo."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
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


def _one_at_a_time(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations
    """torch's ``allreduce_hook``, but each all-reduce is done before the next one starts.

    torch DDP all-reduces sparse tensors with gloo's sparse all-reduce, which now and then
    corrupts the heap when two are in flight (docs/sparse.md): the reference must not crash.
    The arithmetic is that of torch DDP without a hook (divide, then sum).
    """
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size())
    dist.all_reduce(tensor)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(tensor)
    return done


def _ddp(model: torch.nn.Module) -> DDP:
    wrapped = DDP(model)
    wrapped.register_comm_hook(None, _one_at_a_time)
    return wrapped


def _against_ddp(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    name = case.get("name", "sparse")
    opts = case.get("ours", {})
    ours = train(name, lambda m: BucketDataParallel(m, **opts), rank, **case.get("train", {}))
    theirs = train(name, _ddp, rank, **case.get("train", {}))
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
    for rank, r in enumerate(results):
        assert_weights(r["ours"], r["theirs"], rank)
        for name in [n for n in r["theirs"] if n.startswith(("emb.", "bag."))]:
            # The embeddings match to the bit: their sums are gloo's sparse arithmetic.
            assert torch.equal(r["ours"][name], r["theirs"][name]), f"{name} on rank {rank}"
        # One all-reduce per dense bucket (or, with none, for the flags), and two
        # all-gathers for every sparse gradient at once: the row counts, then the rows.
        assert r["stats"].collectives == max(r["buckets"], 1) + 2
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


def _layouts_all_reduced(rank: int, world: int) -> list[torch.layout]:
    seen: list[torch.layout] = []
    real = dist.ProcessGroup.allreduce

    def spy(group: dist.ProcessGroup, tensors: list[torch.Tensor], *args: Any) -> Any:
        seen.extend(t.layout for t in tensors)
        return real(group, tensors, *args)

    dist.ProcessGroup.allreduce = spy  # type: ignore[method-assign,assignment]
    try:
        train("sparse", BucketDataParallel, rank, steps=2)
        train("sparse_only", BucketDataParallel, rank, steps=2)
    finally:
        dist.ProcessGroup.allreduce = real  # type: ignore[method-assign]
    return seen


def test_sparse_gradients_never_go_through_a_sparse_all_reduce() -> None:
    # gloo's sparse all-reduce corrupts the heap now and then when two run at once
    # (docs/sparse.md); the reduction uses dense collectives only.
    for seen in run_ranks(_layouts_all_reduced, 2, timeout=90):
        assert seen and set(seen) == {torch.strided}


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
