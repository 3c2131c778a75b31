"""Which communication hooks keep one order across buckets (``launches_from_callbacks``)."""

from __future__ import annotations

import functools
from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import (
    default_hooks,
    post_localSGD_hook,
    powerSGD_hook,
    quantization_hooks,
)

from bucketddp.comm_hooks import launches_from_callbacks


def _mine(state: Any, bucket: Any) -> Any:
    return None


def test_torch_hooks_that_launch_only_when_called_are_unordered() -> None:
    for hook in (
        default_hooks.allreduce_hook,
        default_hooks.fp16_compress_hook,
        default_hooks.bf16_compress_hook,
        post_localSGD_hook.post_localSGD_hook,
    ):
        assert not launches_from_callbacks(hook), hook.__name__


def test_hooks_that_launch_from_callbacks_and_unknown_hooks_are_ordered() -> None:
    for hook in (
        powerSGD_hook.powerSGD_hook,
        powerSGD_hook.batched_powerSGD_hook,
        quantization_hooks.quantization_pertensor_hook,  # all-gathers again in a callback
        default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),  # a new function
        functools.partial(default_hooks.allreduce_hook),
        _mine,
    ):
        assert launches_from_callbacks(hook)


def test_a_hook_declares_itself() -> None:
    def caller_only(state: Any, bucket: Any) -> Any:
        return None

    caller_only.launches_from_callbacks = False  # type: ignore[attr-defined]
    assert not launches_from_callbacks(caller_only)
    wrapped = default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook)
    wrapped.launches_from_callbacks = True  # type: ignore[attr-defined]
    assert launches_from_callbacks(wrapped)
