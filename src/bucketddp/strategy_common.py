"""What the Trainer strategy and the Fabric strategy share, without importing Lightning.

- ``strategy_names``: the registered names, one twin of each DDP name Lightning registers;
- ``comm_hook_from`` and ``check_model_averaging``: the communication-hook options, checked;
- ``destroy_at_exit``: the default process group a strategy created, destroyed at exit.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import Any, Literal

import torch.distributed as dist

CHECKPOINT_KEY = "bucketddp"
"""The checkpoint entry the strategies add: ``{"bucket_order": [parameter names]}``."""

# Lightning's DDP names and what they mean: (start name, start_method). "ddp_notebook" is
# "ddp_fork" under the name notebook users know.
_STARTS = (("ddp", "popen"), ("ddp_spawn", "spawn"), ("ddp_fork", "fork"), ("ddp_notebook", "fork"))


def strategy_names(family: Literal["trainer", "fabric"]) -> list[tuple[str, dict[str, Any]]]:
    """The bucket twins of the DDP names Lightning registers: ``(name, init arguments)``.

    The Trainer registers each start name alone and with ``_find_unused_parameters_true``
    and ``_false``; Fabric registers the start names and ``ddp_find_unused_parameters_true``.
    Each twin is ``"bucket_"`` + Lightning's name, with the same arguments.
    """
    names: list[tuple[str, dict[str, Any]]] = []
    for start, method in _STARTS:
        names.append((f"bucket_{start}", {"start_method": method}))
    for start, method in _STARTS:
        for unused in (True, False):
            if family == "fabric" and (start, unused) != ("ddp", True):
                continue
            name = f"bucket_{start}_find_unused_parameters_{str(unused).lower()}"
            names.append((name, {"start_method": method, "find_unused_parameters": unused}))
    return names


def describe(cls_name: str, arguments: dict[str, Any]) -> str:
    """A registry entry's description: the strategy as the name constructs it."""
    given = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
    return f"{cls_name}({given})"


def comm_hook_from(
    hook: Callable[..., Any] | None, state: object | None, wrapper: Callable[..., Any] | None
) -> tuple[object | None, Callable[..., Any]] | None:
    """``(state, hook)`` to register on the wrapper, the wrapper applied; None for no hook.

    Raises:
        ValueError: a state or wrapper without a hook.
    """
    if hook is None:
        if state is not None or wrapper is not None:
            raise ValueError(
                "ddp_comm_state and ddp_comm_wrapper apply to a ddp_comm_hook, and none was "
                "given; pass ddp_comm_hook=..., e.g. default_hooks.fp16_compress_hook"
            )
        return None
    return state, (wrapper(hook) if wrapper is not None else hook)


def check_model_averaging(state: object | None, period: int | None) -> None:
    """Post-local SGD needs a model averaging period, and the period needs post-local SGD.

    Raises:
        ValueError: a ``PostLocalSGDState`` without a period, a period without one, or a
            period that is not a positive integer.
    """
    local_sgd = is_post_local_sgd(state)
    if local_sgd and period is None:
        raise ValueError(
            "ddp_comm_state is a PostLocalSGDState, so the ranks step on local gradients "
            "after start_localSGD_iter; pass model_averaging_period=N to average the "
            "parameters every N steps"
        )
    if period is not None and not local_sgd:
        raise ValueError(
            f"model_averaging_period={period} applies to post-local SGD only; pass "
            "ddp_comm_state=PostLocalSGDState(...) and ddp_comm_hook=post_localSGD_hook"
        )
    if period is not None and (
        isinstance(period, bool) or not isinstance(period, int) or period < 1
    ):
        raise ValueError(f"model_averaging_period must be a positive integer, got {period!r}")


def is_post_local_sgd(state: object | None) -> bool:
    """Whether ``state`` is a ``PostLocalSGDState`` (post-local SGD's hook state)."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

    return isinstance(state, PostLocalSGDState)


# The default group a strategy created in this process, destroyed when the interpreter exits.
# Not at teardown: a later trainer.test() or a new Trainer in the same script reuses the
# group, as with DDPStrategy, and re-creating one over the same address races with ranks
# still holding the old one. A gloo group left alive into interpreter shutdown is what
# makes Lightning runs end in "terminate called without an active exception" (SIGABRT).
_created_group: dist.ProcessGroup | None = None


def destroy_at_exit(group: dist.ProcessGroup | None) -> None:
    """Destroy ``group``, the default group a strategy created, when the interpreter exits."""
    global _created_group
    if _created_group is None:
        atexit.register(_destroy_created_group)
    _created_group = group


def _destroy_created_group() -> None:
    global _created_group
    group, _created_group = _created_group, None
    if group is not None and dist.is_initialized() and dist.group.WORLD is group:
        dist.destroy_process_group()
