"""What the Trainer strategy and the Fabric strategy share, without importing Lightning.

- ``StrategyOptions``: the options both take besides the launcher's, checked once;
- ``register_twins``: one twin of each DDP name Lightning registers, in its registry;
- ``destroy_at_exit``: the default process group a strategy created, destroyed at exit;
- ``init_restartable_group``: under torchrun, a default group that forms after a restart.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Protocol

import torch.distributed as dist

from ..elastic.group import init_process_group, uses_agent_store
from ..elastic.session import check_every
from ..options import EngineOptions, check_switches
from ..versions import warn_if_untested

# Both strategy modules import this one: the Lightning release is checked once, read from its
# metadata so that this module stays free of Lightning.
with contextlib.suppress(importlib.metadata.PackageNotFoundError):
    warn_if_untested("lightning", importlib.metadata.version("lightning"))

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


class _Registry(Protocol):
    """Lightning's ``_StrategyRegistry``, as far as ``register_twins`` uses it."""

    def __contains__(self, name: object) -> bool: ...

    def register(self, name: str, strategy: Any, description: str, **init_params: Any) -> Any: ...


def register_twins(cls: type, registry: _Registry, family: Literal["trainer", "fabric"]) -> None:
    """Register ``cls`` under each name of ``strategy_names(family)`` not registered yet."""
    for name, arguments in strategy_names(family):
        if name not in registry:
            given = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
            description = f"{cls.__name__}({given})"
            registry.register(name, cls, description=description, **arguments)


@dataclass(frozen=True)
class StrategyOptions:
    """What a strategy takes besides the launcher's arguments, checked once.

    Attributes:
        engine: the wrapper's options.
        comm_hook: ``(state, hook)`` to register on the wrapper, or None.
        sync_batchnorm: convert BatchNorm layers to ``bucketddp.SyncBatchNorm``.
        averaging: post-local SGD's ``(PostLocalSGDState, model_averaging_period)``, or None.
        snapshot_every: under ``elastic=True``, the steps between snapshots; else None.
    """

    engine: EngineOptions
    comm_hook: tuple[object | None, Callable[..., Any]] | None
    sync_batchnorm: bool
    averaging: tuple[object, int] | None
    snapshot_every: int | None

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], unused_hint: str) -> StrategyOptions:
        """The options among a strategy's ``__init__`` arguments (its ``locals()``).

        Raises:
            TypeError, ValueError: a bad engine option (see ``EngineOptions``), a
                ``sync_batchnorm`` or ``elastic`` other than True or False, a
                ``snapshot_every`` that is not a positive integer, or bad hook options (see
                ``comm_hook_from`` and ``check_model_averaging``).
        """
        engine = EngineOptions.from_arguments(arguments, stacklevel=3, unused_hint=unused_hint)
        check_switches(sync_batchnorm=arguments["sync_batchnorm"], elastic=arguments["elastic"])
        every = check_every(arguments["snapshot_every"])
        state, period = arguments["ddp_comm_state"], arguments["model_averaging_period"]
        hook = comm_hook_from(arguments["ddp_comm_hook"], state, arguments["ddp_comm_wrapper"])
        check_model_averaging(state, period)
        averaging = (state, period) if period is not None else None
        snapshots = every if arguments["elastic"] else None
        return cls(engine, hook, arguments["sync_batchnorm"], averaging, snapshots)


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


def init_restartable_group(backend: str, timeout: timedelta | None) -> None:
    """Under torchrun, create the default group first, on the agent's store with a key
    namespace per attempt, so that it forms after a restart (``bucketddp.elastic.group``);
    Lightning's own setup then finds it made. Anywhere else, do nothing."""
    if not dist.is_initialized() and uses_agent_store():
        init_process_group(backend, timeout=timeout)


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
