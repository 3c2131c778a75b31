"""The engine against torch DDP: the model cases test_engine_vs_ddp.py and test_cuda.py share.

``train_both`` trains a model of ``models.py`` with BucketDataParallel and with torch DDP in
one process group (a ``run_ranks`` target); ``assert_same_as_ddp`` checks what it returned
on every rank.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from models import train

TINY = {"bucket_cap_mb": 0.002, "first_bucket_mb": 0.0005}  # ~500 and ~130 floats


def train_both(rank: int, world: int, name: str, opts: dict[str, Any], kw: dict[str, Any]) -> Any:
    """Train the same model with both systems in one group; return both final states."""
    torch_opts = {
        k: v for k, v in opts.items() if k in ("find_unused_parameters", "gradient_as_bucket_view")
    }
    ours = train(name, partial(BucketDataParallel, **opts), rank, **kw)
    theirs = train(name, partial(DDP, **torch_opts), rank, **kw)
    plan = [b.names for b in ours["wrapped"].bucket_plan]
    return {
        "ours": ours["params"],
        "theirs": theirs["params"],
        "ours_buf": ours["buffers"],
        "theirs_buf": theirs["buffers"],
        "plan": plan,
    }


def assert_same_as_ddp(results: list[dict[str, Any]], tol: float = 1e-6) -> None:
    for rank, r in enumerate(results):
        assert r["ours"].keys() == r["theirs"].keys()
        for n in r["theirs"]:
            diff = (r["ours"][n] - r["theirs"][n]).abs().max().item()
            assert diff <= tol, f"rank {rank} parameter {n}: differs from torch DDP by {diff}"
        for n in r["theirs_buf"]:
            assert torch.equal(r["ours_buf"][n], r["theirs_buf"][n]), f"buffer {n} differs"
    # Every rank ends with the same weights and the same plan.
    for r in results[1:]:
        for n in r["ours"]:
            assert torch.equal(r["ours"][n], results[0]["ours"][n])
        assert r["plan"] == results[0]["plan"]


def _left_on_even(rank: int, step: int) -> bool:
    return (rank + step) % 2 == 0


def _right_only_early_on_rank1(rank: int, step: int) -> bool:
    # "right" is used by rank 1 in steps 0-1, then by no rank: its gradient must stay None
    # (so momentum SGD skips it), as torch DDP leaves globally unused gradients untouched.
    return rank == 0 or step >= 2


CASES = {
    "mlp": ("mlp", {}, {}),
    "conv": ("conv", {}, {}),
    "tied": ("tied", {}, {}),
    "frozen": ("frozen", {}, {}),
    "activation_checkpointing": ("checkpointed", TINY, {}),
    "reentrant_checkpointing": ("reentrant", TINY, {}),
    "mixed_dtype": ("mixed", TINY, {}),
    "tiny_buckets": ("mlp", TINY, {}),
    "no_view": ("mlp", {"gradient_as_bucket_view": False}, {}),
    "zero_grad_keep": ("conv", TINY, {"set_to_none": False}),
    "channels_last": ("channels_last", {}, {}),
    "reparametrized": ("reparametrized", TINY, {}),
    "recurrent": ("recurrent", TINY, {}),
    "channels_last_grads_kept": ("channels_last", TINY, {"set_to_none": False}),
    "no_sync_accumulation": ("mlp", TINY, {"accumulate": 3}),
    "unused_by_rank": (
        "branchy",
        {"find_unused_parameters": True, **TINY},
        {"branch": _left_on_even},
    ),
    "unused_later_globally": (
        "branchy",
        {"find_unused_parameters": True, **TINY},
        {"branch": _right_only_early_on_rank1},
    ),
    "unused_by_rank_no_view": (
        "branchy",
        {"find_unused_parameters": True, "gradient_as_bucket_view": False},
        {"branch": _left_on_even},
    ),
}
