"""Which hooks the reducer runs itself (``reducer/native_hooks.py``), and which it calls."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from bucketddp.reducer.native_hooks import native_hook


@pytest.mark.parametrize("name", ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"])
def test_torchs_averaging_hooks_are_run_natively(name: str) -> None:
    assert native_hook(getattr(default_hooks, name), None) is not None


def _own(state: Any, bucket: Any) -> Any:
    return default_hooks.allreduce_hook(state, bucket)


@pytest.mark.parametrize(
    "hook",
    [
        _own,  # a wrapper of torch's hook: the user's code, called as registered
        functools.partial(default_hooks.allreduce_hook),
        default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
        powerSGD_hook.powerSGD_hook,
    ],
)
def test_any_other_hook_is_called(hook: Any) -> None:
    assert native_hook(hook, None) is None


def test_a_state_that_is_not_a_process_group_leaves_the_hook_to_torch() -> None:
    assert native_hook(default_hooks.allreduce_hook, object()) is None
