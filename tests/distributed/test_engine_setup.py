"""What wrapping a model checks, on real gloo process groups and without one.

Models that differ between ranks, bad on/off options, lazy, meta, frozen and already
wrapped modules are refused, on every rank, naming the fix; parameters and buffers start
from rank 0's values; and importing bucketddp does not import Lightning.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from models import build
from multirank import raised, run_ranks


def _wrap_error(model: torch.nn.Module) -> str:
    """The message of the RuntimeError that wrapping ``model`` raises, or "" if none."""
    try:
        BucketDataParallel(model)
    except RuntimeError as e:
        return str(e)
    return ""


def _mismatch(rank: int, world: int) -> str:
    return _wrap_error(build("mlp") if rank == 0 else build("frozen"))


def test_model_mismatch_raises_on_every_rank() -> None:
    messages = run_ranks(_mismatch, 2, timeout=60)
    for m in messages:
        assert "rank 1 differs from rank 0" in m
        assert "net.0.weight" in m
    assert messages[0] == messages[1]


def _shape_mismatch(rank: int, world: int) -> str:
    return _wrap_error(torch.nn.Linear(4, 3 + rank))


def test_shape_mismatch_names_parameter() -> None:
    for m in run_ranks(_shape_mismatch, 2, timeout=60):
        assert "'weight'" in m and "[3, 4]" in m and "[4, 4]" in m


def _mixed_init() -> torch.nn.Module:
    # Odd sizes and three dtypes (float32, float64, int64 counters) in one broadcast.
    return torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 7).double()
    )


def _initial_broadcast(rank: int, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(rank)  # a different init on every rank
    model = _mixed_init()
    with torch.no_grad():
        model[1].running_mean.fill_(rank)
        model[1].num_batches_tracked.fill_(10 + rank)
    BucketDataParallel(model)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_parameters_and_buffers_start_from_rank0() -> None:
    states = run_ranks(_initial_broadcast, 3)
    torch.manual_seed(0)
    expected = _mixed_init()
    with torch.no_grad():
        expected[1].running_mean.fill_(0)
        expected[1].num_batches_tracked.fill_(10)
    for state in states:
        assert state.keys() == expected.state_dict().keys()
        for k, v in expected.state_dict().items():
            assert state[k].dtype == v.dtype and torch.equal(state[k], v), k


def test_requires_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        BucketDataParallel(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        # A string from a command line: "False" is true, so it would switch the option on.
        (
            "find_unused_parameters",
            "False",
            "find_unused_parameters must be True or False, got str 'False'",
        ),
        ("gradient_as_bucket_view", None, "gradient_as_bucket_view must be True or False"),
        ("static_graph", 2, "static_graph must be True or False, got int 2"),
        ("init_sync", "yes", "init_sync must be True or False"),
        ("broadcast_buffers", "no", "broadcast_buffers must be True, False or None, got str"),
        ("forward_sync_buffers", 0.5, "forward_sync_buffers must be True, False or None"),
    ],
)
def test_on_off_options_refuse_anything_but_a_bool_by_name(
    option: str, value: object, message: str
) -> None:
    # Checked before anything else, so no process group is needed to see it.
    with pytest.raises(TypeError, match=message):
        BucketDataParallel(torch.nn.Linear(2, 2), **{option: value})


def test_on_off_options_take_zero_and_one_as_torch_ddp_does() -> None:
    from bucketddp.options import check_switches

    check_switches(find_unused_parameters=1, static_graph=0, broadcast_buffers=None)


def _lazy(rank: int, world: int) -> str:
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.LazyBatchNorm1d())
    return raised(lambda: BucketDataParallel(lazy))


def test_lazy_modules_are_refused_naming_what_to_do() -> None:
    # torch DDP refuses them too; before, bucketddp raised torch's message about
    # load_state_dict, which did not apply.
    for said in run_ranks(_lazy, 2, timeout=60):
        assert "['0.weight', '0.bias', '1.weight', '1.bias', '1.running_mean'" in said
        assert "run one forward pass on a batch first" in said


def _bad_wrapping(rank: int, world: int) -> dict[str, str]:
    inner = torch.nn.Linear(2, 2)
    with torch.device("meta"):
        on_meta = torch.nn.Linear(2, 2)
    return {
        "ours": raised(lambda: BucketDataParallel(BucketDataParallel(inner)), ValueError),
        "torch": raised(lambda: BucketDataParallel(DDP(inner)), ValueError),
        "nested": raised(
            lambda: BucketDataParallel(torch.nn.Sequential(DDP(inner), torch.nn.ReLU())),
            ValueError,
        ),
        "meta": raised(lambda: BucketDataParallel(on_meta)),
        "function": raised(lambda: BucketDataParallel(torch.relu), TypeError),  # type: ignore[arg-type]
        "group": raised(
            lambda: BucketDataParallel(inner, process_group="gloo"),  # type: ignore[arg-type]
            TypeError,
        ),
    }


def test_wrapping_a_wrapper_or_a_meta_module_is_refused_naming_the_fix() -> None:
    # torch DDP takes a wrapper inside a wrapper and reduces its gradients twice; a meta
    # module, a function or a string for the group fail with unrelated errors. Before, so did
    # bucketddp (the meta module at its first forward).
    for said in run_ranks(_bad_wrapping, 2, timeout=60):
        assert "it is already a BucketDataParallel" in said["ours"]
        assert "it is already a DistributedDataParallel" in said["torch"]
        assert "its submodule '0' is a DistributedDataParallel" in said["nested"]
        for key in ("ours", "torch", "nested"):
            assert "pass wrapper.module instead" in said[key]
        assert "['weight', 'bias'] are on the meta device" in said["meta"]
        assert "module.to_empty(device=...)" in said["meta"]
        assert "wraps an nn.Module, got builtin_function_or_method" in said["function"]
        assert "must be a torch.distributed.ProcessGroup" in said["group"]
        assert "str 'gloo'" in said["group"]


def _nothing_to_train(rank: int, world: int) -> dict[str, Any]:
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    torch.nn.init.constant_(frozen.weight, float(rank))
    ignored = torch.nn.Linear(2, 2)
    ignored.weight.requires_grad_(False)
    BucketDataParallel._set_params_and_buffers_to_ignore_for_model(ignored, ["bias"])
    return {
        "frozen": raised(lambda: BucketDataParallel(frozen), ValueError),
        "weight": frozen.weight[0, 0].item(),
        "ignored": raised(lambda: BucketDataParallel(ignored), ValueError),
    }


def test_a_module_with_nothing_to_train_is_refused_before_any_broadcast() -> None:
    # torch DDP refuses it too. The ranks agree on requires_grad in the model check, so the
    # error comes on every rank, and before parameters are broadcast: each keeps its own.
    for rank, said in enumerate(run_ranks(_nothing_to_train, 2, timeout=60)):
        for key in ("frozen", "ignored"):
            assert "needs at least one parameter with requires_grad=True" in said[key]
            assert "Unfreeze the parameters to train" in said[key]
        assert said["weight"] == float(rank)


def test_import_does_not_pull_lightning() -> None:
    code = (
        "import sys, bucketddp; "
        "assert not any(m == 'lightning' or m.startswith(('lightning.', 'pytorch_lightning')) "
        "for m in sys.modules), sorted(m for m in sys.modules if 'lightning' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
