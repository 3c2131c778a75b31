"""Device arguments (device_ids, output_device) and moving forward inputs to the device.

torch DDP's device keywords are accepted and checked against the module's device, on a CPU
module on gloo ranks and, as pure functions, for CUDA devices; inputs move through nested
containers.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from bucketddp import BucketDataParallel
from bucketddp.forward_io import to_device
from bucketddp.placement import input_device
from models import build
from multirank import run_ranks


def _device_ids_on_cpu(rank: int, world: int) -> dict[str, str]:
    """What each wrapper says to torch DDP's device arguments on a CPU module."""
    said = {}
    for label, kwargs in {
        "device_ids": {"device_ids": [rank]},
        # Not an integer: torch DDP lets output_device=0 pass on a CPU module (it tests the
        # value's truth), so its ranks would disagree and hang in the next collective.
        "output_device": {"output_device": "cuda:0"},
        "empty": {"device_ids": []},
    }.items():
        for system, wrap in (("ours", BucketDataParallel), ("torch", DDP)):
            try:
                wrap(build("mlp"), **kwargs)
                said[f"{label}/{system}"] = "ok"
            except ValueError as e:
                said[f"{label}/{system}"] = str(e)
    return said


def test_device_arguments_follow_torch_ddp_on_cpu() -> None:
    # torch DDP's own keywords are accepted; a CPU module refuses a device, as torch DDP's
    # does, on every rank before any collective, and ``[]`` means none.
    for said in run_ranks(_device_ids_on_cpu, 2, timeout=60):
        for label in ("device_ids", "output_device"):
            assert said[f"{label}/torch"] != "ok"
            assert "module's parameters are on cpu" in said[f"{label}/ours"]
            assert "pass neither (the default) for a CPU module" in said[f"{label}/ours"]
        assert said["empty/ours"] == said["empty/torch"] == "ok"


@pytest.mark.parametrize(
    ("devices", "device_ids", "output_device", "expected"),
    [
        ({"cuda:1"}, [1], None, "cuda:1"),
        ({"cuda:1"}, ["cuda:1"], 1, "cuda:1"),
        ({"cuda:1"}, ["cuda"], None, "cuda:1"),  # no index: the module's own, as torch DDP
        ({"cuda:1"}, [torch.device("cuda", 1)], "cuda:1", "cuda:1"),
        ({"cuda:0"}, None, None, None),
        ({"cpu"}, [], None, None),
    ],
)
def test_device_ids_name_the_module_device(
    devices: set[str], device_ids: Any, output_device: Any, expected: str | None
) -> None:
    got = input_device({torch.device(d) for d in devices}, device_ids, output_device)
    assert got == (None if expected is None else torch.device(expected))


@pytest.mark.parametrize(
    ("devices", "device_ids", "output_device", "message"),
    [
        ({"cuda:0"}, [0, 1], None, "give exactly one device per process"),
        ({"cuda:0"}, [1], None, "device_ids[0] names cuda:1, but the module's parameters are"),
        ({"cuda:0"}, [0], "cuda:1", "output_device names cuda:1"),
        ({"cuda:0", "cuda:1"}, [0], None, "cuda:0, cuda:1; pass neither for a module that spans"),
    ],
)
def test_device_ids_that_miss_the_module_device_are_refused(
    devices: set[str], device_ids: Any, output_device: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        input_device({torch.device(d) for d in devices}, device_ids, output_device)


def test_inputs_move_to_the_device_through_containers() -> None:
    point = collections.namedtuple("point", "x y")
    inputs = (
        torch.ones(2),
        [torch.ones(1), 3, "text"],
        {"p": point(torch.ones(3), None)},
        collections.defaultdict(list, {"d": torch.zeros(1)}),
    )
    moved = to_device(inputs, torch.device("meta"))
    assert moved[0].is_meta and moved[1][0].is_meta and moved[1][1:] == [3, "text"]
    assert type(moved[2]["p"]) is point and moved[2]["p"].x.is_meta and moved[2]["p"].y is None
    assert type(moved[3]) is collections.defaultdict and moved[3]["d"].is_meta
    assert not inputs[0].is_meta  # the originals stay where they were
