"""A communication hook's state in snapshots (``bucketddp.hook_state``): what is kept, where.

The distributed claim (a PowerSGD job killed and restarted is bit-equal to one that never
stopped) is tested on real torchrun jobs in tests/lightning/test_elastic_trainer.py; these
check the split into shared and per-rank parts and what happens at another world size.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from bucketddp import hook_state
from bucketddp.elastic.loop import restore_hook


def _used_state() -> PowerSGDState:
    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    state.iter = 7
    state.rng.randint(1_000_000_000)  # the generator moved on, as after a compressed step
    state.error_dict[0] = torch.randn(5)
    state.p_memory_dict[0] = torch.randn(3)
    state.q_memory_dict[0] = torch.randn(2)
    return state


def _through_torch_save(obj: Any) -> Any:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_powersgd_comes_back_whole_at_the_same_world_size() -> None:
    saved = _used_state()
    shared, own = hook_state.capture(saved)
    # Both parts hold plain values and tensors: no pickled NumPy object.
    shared, own = _through_torch_save(shared), _through_torch_save(own)
    fresh = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    hook_state.restore(fresh, shared, own, had_own=True)
    assert fresh.iter == 7
    assert fresh.rng.randint(1_000_000_000) == copy.deepcopy(saved.rng).randint(1_000_000_000)
    for name in hook_state.PER_RANK:
        assert torch.equal(getattr(fresh, name)[0], getattr(saved, name)[0]), name


def test_at_another_world_size_the_per_rank_part_starts_afresh_with_a_warning() -> None:
    shared, _ = hook_state.capture(_used_state())
    fresh = _used_state()  # memories of its own, which must not survive either
    with pytest.warns(UserWarning, match="world size changed"):
        hook_state.restore(fresh, shared, None, had_own=True)
    assert fresh.iter == 7
    assert not fresh.error_dict and not fresh.p_memory_dict and not fresh.q_memory_dict


class _Counter:
    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls}

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.calls = d["calls"]


def test_a_users_state_takes_part_through_state_dict() -> None:
    saved = _Counter()
    saved.calls = 3
    shared, own = hook_state.capture(saved)
    assert shared is None
    fresh = _Counter()
    hook_state.restore(fresh, shared, own, had_own=True)
    assert fresh.calls == 3
    assert hook_state.capture(None) == (None, None)  # the default hooks' state


def test_resuming_a_hooks_state_before_the_hook_is_registered_is_refused() -> None:
    entry = {"shared": None, "has_own": True}
    wrapper: Any = types.SimpleNamespace(comm_hook_state=None)
    with pytest.raises(RuntimeError, match="call register_comm_hook before resuming"):
        restore_hook(wrapper, entry, {"state_dict": {}})
    restore_hook(wrapper, {"shared": None, "has_own": False}, None)  # nothing to put back
