"""torch DDP's init_sync, forward_sync_buffers and device_mesh, against torch DDP on gloo."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from bucketddp.options import buffer_default
from models import assert_pairs_match, assert_weights, paired, train
from multirank import raised, run_ranks

# Options torch DDP and bucketddp both take, with what they do to a conv net whose
# parameters and BatchNorm statistics start from rank-dependent values.
CASES: dict[str, dict[str, Any]] = {
    "init_sync_off": {"init_sync": False},
    "forward_sync_off": {"forward_sync_buffers": False},
    "forward_sync_on": {"forward_sync_buffers": True},
    "both_off": {"init_sync": False, "forward_sync_buffers": False},
}


def _apart(rank: int, wrapper: Callable[..., nn.Module], opts: dict[str, Any]) -> Any:
    def wrap(model: nn.Module) -> nn.Module:
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if t.is_floating_point():
                    t.add_(0.1 * rank)
        return wrapper(model, **opts)

    return wrap


def _against_ddp(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    ours = train("conv", _apart(rank, BucketDataParallel, opts), rank)
    theirs = train("conv", _apart(rank, DDP, opts), rank)
    return paired(ours, theirs)


@pytest.mark.parametrize("case", CASES)
def test_sync_options_give_the_weights_and_buffers_of_torch_ddp(case: str) -> None:
    opts = CASES[case]
    missing = sorted(set(opts) - set(inspect.signature(DDP).parameters))
    if missing:  # init_sync came in torch 2.7 to 2.10, forward_sync_buffers in 2.13
        pytest.skip(f"torch DDP {torch.__version__} takes no {missing}: no ground truth here")
    results = run_ranks(_against_ddp, 2, opts, timeout=90)
    assert_pairs_match(results)
    params = [r["params"][0] for r in results]
    # init_sync=False keeps each rank's parameters (and the averaged steps keep them apart).
    apart = not torch.allclose(params[0]["head.weight"], params[1]["head.weight"], atol=0.05)
    assert apart == (opts.get("init_sync") is False)


def _mesh(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    ours = train("mlp", lambda m: BucketDataParallel(m, device_mesh=mesh), rank)
    theirs = train("mlp", lambda m: DDP(m, device_mesh=mesh), rank)
    flat = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "dp"))
    return {
        "ours": ours["params"],
        "theirs": theirs["params"],
        "same_group": ours["wrapped"].process_group is mesh.get_group(0),
        "both": raised(
            lambda: BucketDataParallel(
                nn.Linear(2, 2), device_mesh=mesh, process_group=mesh.get_group(0)
            ),
            ValueError,
        ),
        "2d": raised(lambda: BucketDataParallel(nn.Linear(2, 2), device_mesh=flat), ValueError),
        "dp_slice": BucketDataParallel(nn.Linear(2, 2), device_mesh=flat["dp"]).process_group
        is flat["dp"].get_group(0),
    }


def test_device_mesh_reduces_over_its_group_as_torch_ddp_does() -> None:
    for rank, r in enumerate(run_ranks(_mesh, 2, timeout=90)):
        assert_weights(r["ours"], r["theirs"], rank)
        assert r["same_group"] and r["dp_slice"]
        assert "either process_group or device_mesh, not both" in r["both"]
        assert "device_mesh has 2 dimensions ('pp', 'dp')" in r["2d"]
        assert "device_mesh['dp']" in r["2d"]


def test_buffer_options_agree_or_raise() -> None:
    assert buffer_default(None, None, None) == "broadcast"
    assert buffer_default(False, None, None) == "none"
    assert buffer_default(None, False, None) == "none"
    assert buffer_default(True, True, "mean") == "mean"
    assert buffer_default(None, False, "none") == "none"
    with pytest.raises(ValueError, match="broadcast_buffers=False contradicts forward_sync_"):
        buffer_default(False, True, None)
    with pytest.raises(ValueError, match="forward_sync_buffers=False contradicts default_buf"):
        buffer_default(None, False, "max")
    with pytest.raises(ValueError, match="broadcast_buffers=False contradicts default_buffer"):
        buffer_default(False, None, "broadcast")
    with pytest.raises(ValueError, match="broadcast_buffers=True contradicts default_buffer"):
        buffer_default(True, None, "none")
    with pytest.raises(ValueError, match="forward_sync_buffers=True contradicts default_buf"):
        buffer_default(None, True, "none")


def _dcp_keys(rank: int, world: int) -> dict[str, Any]:
    """torch.distributed.checkpoint's state-dict helpers: torch DDP against our recipe."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )

    trained = {}
    for name, wrap in (("ddp", DDP), ("ours", BucketDataParallel)):
        out = train("conv", wrap, rank)
        wrapped = out["wrapped"]
        # torch DDP's helpers strip its "module." prefix; ours is passed the inner module.
        target = wrapped if name == "ddp" else wrapped.module
        opt = torch.optim.SGD(wrapped.module.parameters(), lr=0.1, momentum=0.9)
        wrapped(torch.randn(2, 3, 8, 8)).sum().backward()
        opt.step()
        trained[name] = (
            target,
            get_model_state_dict(target),
            get_optimizer_state_dict(target, opt),
        )
    # A checkpoint of torch DDP's loads into the wrapped module, and the other way round.
    set_model_state_dict(trained["ours"][0], trained["ddp"][1])
    loaded = {k: v.clone() for k, v in trained["ours"][0].state_dict().items()}
    return {
        "model_keys": [sorted(trained[n][1]) for n in ("ddp", "ours")],
        "optim_keys": [sorted(trained[n][2]["state"]) for n in ("ddp", "ours")],
        "loaded": loaded,
        "ddp": {k: v.clone() for k, v in trained["ddp"][1].items()},
    }


def test_distributed_checkpoint_helpers_on_the_wrapped_module_match_torch_ddp() -> None:
    for r in run_ranks(_dcp_keys, 2, timeout=90):
        ddp_keys, our_keys = r["model_keys"]
        assert ddp_keys == our_keys and "features.0.weight" in our_keys
        assert r["optim_keys"][0] == r["optim_keys"][1]
        for k, v in r["ddp"].items():
            assert torch.equal(r["loaded"][k], v), k


# broadcast_buffers alone and beside forward_sync_buffers, and the options without it.
DEPRECATION_CASES: list[dict[str, Any]] = [
    {"broadcast_buffers": True},
    {"broadcast_buffers": False},
    {"broadcast_buffers": True, "forward_sync_buffers": True},
    {"forward_sync_buffers": False},
    {},
]


def _deprecation_warnings(rank: int, world: int) -> list[dict[str, list[str]]]:
    import warnings

    seen = []
    for opts in DEPRECATION_CASES:
        got: dict[str, list[str]] = {}
        for name, wrap in (("ddp", DDP), ("ours", BucketDataParallel)):
            if name == "ddp" and "forward_sync_buffers" not in inspect.signature(DDP).parameters:
                opts = {k: v for k, v in opts.items() if k != "forward_sync_buffers"}  # < 2.13
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                wrap(nn.BatchNorm1d(2), **opts)
            got[name] = [
                f"{w.category.__name__}: {w.message} @ {w.filename}"
                for w in caught
                if "broadcast_buffers" in str(w.message)
            ]
        seen.append(got)
    return seen


def test_broadcast_buffers_warns_as_torch_ddp_does() -> None:
    for seen in run_ranks(_deprecation_warnings, 2):
        for opts, got in zip(DEPRECATION_CASES, seen, strict=True):
            # Where torch DDP warns, so do we: one FutureWarning, at the caller's line.
            assert len(got["ours"]) == len(got["ddp"]) <= 1, (opts, got)
            for text in got["ours"]:
                assert text.startswith("FutureWarning: broadcast_buffers is deprecated"), text
                assert 'default_buffer_policy="none"' in text
                assert text.endswith("test_torch_options.py"), text
        # torch DDP deprecates it from the release that takes forward_sync_buffers (2.13).
        assert bool(seen[0]["ddp"]) == ("forward_sync_buffers" in inspect.signature(DDP).parameters)
