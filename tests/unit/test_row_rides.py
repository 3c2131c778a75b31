"""The agreement row riding in a hook's last bucket: which hooks carry it, and the world sizes
where it is exact."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from bucketddp.comm_hooks import (
    averages_exactly,
    averaging_wire,
    fit_row_error,
    row_in_powersgd,
)


def _largest_exact(wire: torch.dtype) -> int:
    world = 1
    while averages_exactly(wire, world + 1):
        world += 1
    return world


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_every_count_comes_back_exactly_up_to_the_bound(wire: torch.dtype) -> None:
    # Up to the largest world size allowed, k ranks' flags averaged in ``wire`` (each 1/world
    # rounded, then added one rank at a time, as a ring all-reduce adds) and multiplied
    # back round to k, for every k.
    bound = _largest_exact(wire)
    assert bound >= 4
    for world in range(2, bound + 1):
        share = torch.tensor(1.0 / world, dtype=wire)
        for k in range(world + 1):
            total = torch.zeros((), dtype=wire)
            for _ in range(k):
                total = total + share
            assert round(float(total) * world) == k, (wire, world, k)


def test_the_bound_keeps_out_world_sizes_where_the_dtype_miscounts() -> None:
    # At 27 ranks bfloat16 no longer counts every rank (25 flags come back as 24 or 26):
    # a world size the bound refuses.
    world = 27
    share = torch.tensor(1.0 / world, dtype=torch.bfloat16)
    total = torch.zeros((), dtype=torch.bfloat16)
    counts = []
    for _ in range(world):
        total = total + share
        counts.append(round(float(total) * world))
    assert counts != list(range(1, world + 1))
    assert not averages_exactly(torch.bfloat16, world)


def test_only_torch_averaging_hooks_carry_the_row() -> None:
    assert averaging_wire(default_hooks.allreduce_hook, torch.float32) is torch.float32
    assert averaging_wire(default_hooks.fp16_compress_hook, torch.float32) is torch.float16
    assert averaging_wire(default_hooks.bf16_compress_hook, torch.float32) is torch.bfloat16
    wrapped = default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)
    assert averaging_wire(wrapped, torch.float32) is None
    assert not averages_exactly(torch.int32, 2)


def test_only_torch_powersgd_hook_with_a_state_that_never_compresses_a_row_carries_it() -> None:
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1)
    assert row_in_powersgd(powerSGD_hook.powerSGD_hook, state)
    # The batched hook compresses the whole buffer, the row included.
    assert not row_in_powersgd(powerSGD_hook.batched_powerSGD_hook, state)
    # Under a compression rate below 1 an n x 1 tensor would be compressed too.
    low = powerSGD_hook.PowerSGDState(process_group=None, min_compression_rate=0.5)
    assert not row_in_powersgd(powerSGD_hook.powerSGD_hook, low)
    assert not row_in_powersgd(default_hooks.allreduce_hook, None)


def test_the_row_gets_no_error_feedback_and_a_saved_entry_of_the_other_layout_fits() -> None:
    state = powerSGD_hook.PowerSGDState(process_group=None)
    fit_row_error(state, 0, 3, 5, True)  # no entry yet: nothing to fit
    assert state.error_dict == {}
    state.error_dict[0] = torch.arange(1.0, 6.0)
    fit_row_error(state, 0, 3, 5, True)  # the row's part is zeroed, the gradients' kept
    assert state.error_dict[0].tolist() == [1.0, 2.0, 3.0, 0.0, 0.0]
    state.error_dict[0] = torch.arange(1.0, 4.0)  # saved where the row went alone
    fit_row_error(state, 0, 3, 5, True)
    assert state.error_dict[0].tolist() == [1.0, 2.0, 3.0, 0.0, 0.0]
    fit_row_error(state, 0, 3, 5, False)  # and back
    assert state.error_dict[0].tolist() == [1.0, 2.0, 3.0]
    state.error_dict[0] = torch.arange(1.0, 8.0)  # another layout: PowerSGD will say so
    fit_row_error(state, 0, 3, 5, True)
    assert state.error_dict[0].numel() == 7
