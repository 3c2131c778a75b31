"""Parameters and buffers in ``_ddp_params_and_buffers_to_ignore``, against torch DDP on gloo."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from models import assert_pairs_match, assert_weights, build, paired, train
from multirank import raised, run_ranks

IGNORED = ["head.bias", "features.1.running_mean"]


def _rank_local(rank: int, setter: Callable[[nn.Module, list[str]], None]) -> Callable[..., Any]:
    """A wrap step: give the ignored tensors rank-dependent values, then ignore them."""

    def prepare(model: nn.Module) -> nn.Module:
        with torch.no_grad():
            model.head.bias.add_(rank)
            model.features[1].running_mean.add_(rank)
        setter(model, IGNORED)
        return model

    return prepare


def _against_ddp(rank: int, world: int) -> dict[str, Any]:
    ours_prep = _rank_local(rank, BucketDataParallel._set_params_and_buffers_to_ignore_for_model)
    theirs_prep = _rank_local(rank, DDP._set_params_and_buffers_to_ignore_for_model)
    ours = train("conv", lambda m: BucketDataParallel(ours_prep(m)), rank)
    theirs = train("conv", lambda m: DDP(theirs_prep(m)), rank)
    return paired(ours, theirs)


def test_ignored_parameters_and_buffers_stay_rank_local_as_with_torch_ddp() -> None:
    results = run_ranks(_against_ddp, 2, timeout=90)
    assert_pairs_match(results)
    # The ignored tensors were never averaged nor broadcast: they still differ by rank.
    params0, params1 = results[0]["params"][0], results[1]["params"][0]
    assert not torch.allclose(params0["head.bias"], params1["head.bias"], atol=0.5)
    assert torch.equal(params0["head.weight"], params1["head.weight"])
    buffers0, buffers1 = results[0]["buffers"][0], results[1]["buffers"][0]
    assert not torch.allclose(
        buffers0["features.1.running_mean"], buffers1["features.1.running_mean"], atol=0.5
    )


def _with_local_extra(wrapper: Callable[..., nn.Module]) -> Callable[[nn.Module], nn.Module]:
    def wrap(model: nn.Module) -> nn.Module:
        # A parameter of its own per rank, shaped by the rank, that the forward never uses.
        # It sits in a submodule: torch DDP 2.13 still gives one on the root module to its
        # reducer (it looks it up as ".extra"), so there it is no ground truth.
        rank = torch.distributed.get_rank()
        model.net.extra = nn.Parameter(torch.zeros(rank + 1))
        model._ddp_params_and_buffers_to_ignore = ["net.extra"]
        return wrapper(model)

    return wrap


def _differing_shapes(rank: int, world: int, join: bool) -> tuple[Any, Any]:
    opts: dict[str, Any] = {"steps": [3, 2], "join": {}} if join else {}
    ours = train("mlp", _with_local_extra(BucketDataParallel), rank, **opts)["params"]
    theirs = train("mlp", _with_local_extra(DDP), rank, **opts)["params"]
    return ours, theirs


def test_an_ignored_parameter_may_differ_in_shape_and_get_no_gradient() -> None:
    # find_unused_parameters stays False: the ignored parameter is not the reducer's business.
    # With join(), the final broadcast of the last joiner's parameters must skip it too.
    for join in (False, True):
        for rank, (ours, theirs) in enumerate(run_ranks(_differing_shapes, 2, join, timeout=90)):
            assert_weights(ours, theirs, rank)
            assert ours["net.extra"].shape == (rank + 1,)


def _errors(rank: int, world: int) -> dict[str, str]:
    def wrap(ignored: Any, **kwargs: Any) -> Callable[[], object]:
        model = build("conv")
        model._ddp_params_and_buffers_to_ignore = ignored
        return lambda: BucketDataParallel(model, **kwargs)

    said = {
        "differ": raised(wrap(["head.bias"] if rank == 1 else [])),
        "rule": raised(wrap(IGNORED, buffer_sync={"features.1.running_mean": "mean"}), ValueError),
        "all": raised(wrap([n for n, _ in build("conv").named_parameters()]), ValueError),
        "string": raised(wrap("head.bias"), TypeError),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        BucketDataParallel(build("conv"), buffer_sync=None)  # no ignore list: no warning
        wrap(["head.bais", "head.bias"])()
    said["warning"] = " | ".join(str(w.message) for w in caught)
    return said


def test_ignore_list_errors_name_the_culprit_on_every_rank() -> None:
    for said in run_ranks(_errors, 2, timeout=60):
        assert "it ignores ['head.bias'] where rank 0 ignores []" in said["differ"]
        assert "must list the same names on every rank" in said["differ"]
        assert "'features.1.running_mean'" in said["rule"]
        assert "_ddp_params_and_buffers_to_ignore lists it" in said["rule"]
        assert "requires_grad=True" in said["all"]
        assert "_ddp_params_and_buffers_to_ignore do not count" in said["all"]
        assert "set it to a list of parameter and buffer names" in said["string"]
        assert said["warning"].count("name no parameter or buffer") == 1
        assert "['head.bais']" in said["warning"]
