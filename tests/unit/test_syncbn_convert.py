"""SyncBatchNorm in one process: converting a model and back keeps every layer's settings,
state, hooks and attributes, and without a process group the layer is BatchNorm."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from bucketddp.syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _model() -> nn.Module:
    model = nn.Sequential(
        nn.BatchNorm1d(4),
        nn.Sequential(nn.BatchNorm2d(5, momentum=None), nn.BatchNorm3d(6, affine=False)),
        nn.BatchNorm2d(7, track_running_stats=False),
        nn.SyncBatchNorm(8),
        nn.BatchNorm2d(9),
    )
    model[4].weight.requires_grad_(False)  # a frozen layer
    model[4].eval()
    with torch.no_grad():
        for buf_owner in model.modules():
            if getattr(buf_owner, "running_mean", None) is not None:
                buf_owner.running_mean.uniform_()
                buf_owner.num_batches_tracked.fill_(3)
    return model


def test_convert_then_revert_restores_everything():
    model = _model()
    before = copy.deepcopy(model.state_dict())
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    classes = [type(m) for m in model.modules()]
    flags = [m.training for m in model.modules()]

    converted = convert_sync_batchnorm(model)
    assert converted is model
    layers = [m for m in converted.modules() if isinstance(m, _BatchNorm)]
    assert all(type(m) is SyncBatchNorm for m in layers) and len(layers) == 6
    assert [m.training for m in converted.modules()] == flags
    assert all(p is params[n] for n, p in converted.named_parameters())
    assert all(b is buffers[n] for n, b in converted.named_buffers())
    assert not converted[4].weight.requires_grad
    assert converted[1][0].momentum is None and converted[2].running_mean is None

    reverted = revert_sync_batchnorm(converted)
    assert [type(m) for m in reverted.modules()] == classes
    assert [m.training for m in reverted.modules()] == flags
    assert all(p is params[n] for n, p in reverted.named_parameters())
    assert all(b is buffers[n] for n, b in reverted.named_buffers())
    after = reverted.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert not any(hasattr(m, "converted_from") for m in reverted.modules())
    assert not hasattr(reverted[0], "process_group") and hasattr(reverted[3], "process_group")


def test_dimension_checks_survive_the_round_trip():
    converted = convert_sync_batchnorm(_model())
    good = {0: (2, 4, 3), 1: (2, 5, 3, 3), 3: (2, 8, 3)}
    bad = {0: (2, 4, 3, 3), 1: (2, 5, 3), 3: (8,)}
    for stage in ("converted", "reverted"):
        layers = {0: converted[0], 1: converted[1][0], 3: converted[3]}
        for i, layer in layers.items():
            layer.eval()
            layer(torch.randn(good[i]))
            with pytest.raises(ValueError, match=r"\dD input"):
                layer(torch.randn(bad[i]))
        if stage == "converted":
            converted = revert_sync_batchnorm(converted)


def test_root_module_and_directly_built_layers():
    bn = nn.BatchNorm3d(2)
    sync = convert_sync_batchnorm(bn)
    assert type(sync) is SyncBatchNorm and sync.weight is bn.weight
    assert sync.converted_from is nn.BatchNorm3d
    assert type(revert_sync_batchnorm(sync)) is nn.BatchNorm3d

    direct = SyncBatchNorm(3, momentum=None)
    direct(torch.randn(4, 3, 5))  # any dimensionality >= 2
    direct(torch.randn(4, 3, 2, 2))
    with pytest.raises(ValueError, match="at least 2"):
        direct(torch.randn(3))
    # Not converted, so not reverted either: convert then revert leaves it as it was (as
    # Lightning's sync_batchnorm=True does around fit). Before, it became torch's
    # SyncBatchNorm, which fails on CPU in a process group.
    model = nn.Sequential(nn.BatchNorm1d(3), direct)
    back = revert_sync_batchnorm(convert_sync_batchnorm(model))
    assert type(back[0]) is nn.BatchNorm1d and back[1] is direct
    assert revert_sync_batchnorm(direct) is direct


def test_hooks_and_own_attributes_survive_the_round_trip():
    # bias=False came with newer torch; older ones still test the rest.
    no_bias = "bias" in inspect.signature(nn.BatchNorm1d).parameters
    bn = nn.BatchNorm1d(3, **({"bias": False} if no_bias else {}))
    bn.note = "mine"
    calls = []
    bn.register_forward_hook(lambda mod, args, out: calls.append(type(mod).__name__))
    sync = convert_sync_batchnorm(bn)
    assert (sync.bias is None) == no_bias and sync.note == "mine"
    if no_bias:
        assert SyncBatchNorm(3, bias=False).bias is None
    sync(torch.randn(4, 3))
    back = revert_sync_batchnorm(sync)
    back(torch.randn(4, 3))
    assert calls == ["SyncBatchNorm", "BatchNorm1d"]
    assert back.note == "mine" and (back.bias is None) == no_bias
    # A handle taken before the round trip still removes its hook (before, the hook dicts
    # were copies, and the hook kept firing).
    handle = back.register_forward_pre_hook(lambda mod, args: calls.append("pre"))
    sync = convert_sync_batchnorm(back)
    back = revert_sync_batchnorm(sync)
    back(torch.randn(4, 3))
    handle.remove()
    back(torch.randn(4, 3))
    sync(torch.randn(4, 3))
    assert calls[2:] == ["pre", "BatchNorm1d", "BatchNorm1d", "SyncBatchNorm"]
    # Parameters and buffers stay apart: registering one on a layer leaves the other alone.
    back.register_buffer("extra", torch.zeros(1))
    assert "extra" not in dict(sync.named_buffers())


def test_lazy_layers_must_be_materialized_first():
    with pytest.raises(ValueError, match="run one forward pass"):
        convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_without_process_group_it_is_batchnorm(momentum: float | None):
    ref = nn.BatchNorm2d(3, momentum=momentum)
    sync = SyncBatchNorm(3, momentum=momentum)
    sync.load_state_dict(ref.state_dict())
    for step in range(3):
        x = torch.randn(4, 3, 2, 2) + step
        xr, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        (ref(xr) * x).sum().backward()
        (sync(xs) * x).sum().backward()
        torch.testing.assert_close(xs.grad, xr.grad, **TOL)
    torch.testing.assert_close(sync.weight.grad, ref.weight.grad, **TOL)
    for name, buf in ref.named_buffers():
        torch.testing.assert_close(getattr(sync, name), buf, **TOL)
    assert SyncBatchNorm.default_buffer_policy == "none"
