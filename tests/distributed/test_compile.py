"""BucketDataParallel under torch.compile, against eager torch DDP on real gloo groups.

The models compile with the ``aot_eager`` backend: Dynamo captures the graph and
AOTAutograd splits forward from backward exactly as for the default inductor backend, so
the gradient hooks meet the same autograd graph, but no C++ compiler runs. (The inductor
backend was checked by hand; see docs/compile.md.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from models import batch, build, train
from multirank import run_ranks

BACKEND = "aot_eager"


def _wrapper(where: str) -> Callable[[nn.Module], nn.Module]:
    if where == "outside":  # torch.compile(BucketDataParallel(model))
        return lambda m: torch.compile(BucketDataParallel(m), backend=BACKEND)
    return lambda m: BucketDataParallel(torch.compile(m, backend=BACKEND))


def _compiled_vs_ddp(rank: int, world: int, name: str, where: str, accumulate: int) -> Any:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ours = train(name, _wrapper(where), rank, accumulate=accumulate)
    graphs = counters["stats"]["unique_graphs"]
    breaks = list(counters["graph_break"])
    theirs = train(name, DDP, rank, accumulate=accumulate)
    return {
        "ours": ours["params"],
        "theirs": theirs["params"],
        "ours_buf": ours["buffers"],
        "theirs_buf": theirs["buffers"],
        "graphs": graphs,
        "breaks": breaks,
        "collectives": ours["wrapped"].comm_stats.collectives,
    }


@pytest.mark.parametrize(
    ("name", "where", "accumulate"),
    [("conv", "outside", 1), ("conv", "inside", 1), ("mlp", "outside", 2)],
)
def test_compiled_model_matches_eager_torch_ddp(name: str, where: str, accumulate: int) -> None:
    results = run_ranks(_compiled_vs_ddp, 2, name, where, accumulate, timeout=180)
    for rank, r in enumerate(results):
        for n, want in r["theirs"].items():
            torch.testing.assert_close(
                r["ours"][n], want, rtol=0, atol=1e-6, msg=f"{n} rank {rank}"
            )
        for n, want in r["theirs_buf"].items():
            torch.testing.assert_close(r["ours_buf"][n], want, rtol=0, atol=1e-6, msg=n)
        assert r["collectives"] >= 1
        # The model is one graph, compiled once for all steps (no recompiles). Wrapped from
        # outside, the wrapper's bookkeeping is the one graph break, run eagerly.
        assert r["graphs"] == 1
        if where == "inside":
            assert r["breaks"] == []
        else:
            assert r["breaks"] and all("disable" in reason for reason in r["breaks"])
    for n in results[0]["ours"]:
        assert torch.equal(results[0]["ours"][n], results[1]["ours"][n])


def _compiled_autograd(rank: int, world: int) -> dict[str, Any]:
    model = BucketDataParallel(build("mlp"))
    torch._dynamo.config.compiled_autograd = True

    @torch.compile(backend=BACKEND)
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        F.mse_loss(model(x), y).backward()

    try:
        step(*batch("mlp", 0, rank))
    except RuntimeError as e:
        return {"error": str(e), "collectives": model.comm_stats.collectives}
    finally:
        torch._dynamo.config.compiled_autograd = False
    return {"error": None}


def test_compiled_autograd_is_refused_on_every_rank() -> None:
    # Compiled autograd would trace the gradient hooks into its graph and skip the
    # reduction; every rank stops at its first hook instead, before any collective.
    for r in run_ranks(_compiled_autograd, 2, timeout=120):
        assert r["error"] is not None, "compiled autograd ran without an error"
        assert "does not support compiled autograd" in r["error"]
        assert "torch.compile of the model" in r["error"]
        assert r["collectives"] == 0


def _eager_step_loads_dynamo(rank: int, world: int) -> bool:
    import sys

    model = BucketDataParallel(build("mlp"))
    x, y = batch("mlp", 0, rank)
    F.mse_loss(model(x), y).backward()
    return "torch._dynamo" in sys.modules


def test_eager_training_does_not_import_dynamo() -> None:
    # Importing torch._dynamo takes about a second; an eager program never pays for it. The
    # suite's ranks have it preloaded (tests/conftest.py): this one starts fresh.
    assert run_ranks(_eager_step_loads_dynamo, 1, fresh=True) == [False]
