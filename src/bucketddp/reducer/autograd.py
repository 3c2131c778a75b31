"""Glue to torch's autograd engine: parameter hooks, node hooks, compiled autograd."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

COMPILED_AUTOGRAD = (
    "BucketDataParallel does not support compiled autograd "
    "(torch._dynamo.config.compiled_autograd): its gradient hooks launch collectives and "
    "wait for them outside any graph. Turn compiled autograd off; torch.compile of the "
    "model, inside or outside the wrapper, is supported."
)


def compiled_autograd() -> bool:
    """Whether this backward runs under compiled autograd, where the hooks cannot work.

    Dynamo traces the hooks there (``is_compiling``). Where it falls back to running one
    eagerly, compiled autograd's own flag tells (a private module attribute, read only if
    that module is loaded). Checked once per backward, at its first hook.
    """
    if torch.compiler.is_compiling():
        return True
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(module, "in_compiled_autograd_region", False))


class Once:
    """A node post-hook that calls ``fn()`` the first time it runs, and never again."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn: Callable[[], None] | None = fn

    def __call__(self, *_: Any) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


def ready_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
    """Have ``hook(param)`` run after each gradient is accumulated into ``param``.

    Also for a parameter that is frozen right now: a member of the plan frozen after it
    joined (when parameters unfrozen on every rank join the plan, the others are hooked
    anew). torch refuses the registration on a tensor that does not require a gradient,
    so ``requires_grad`` is set for the registration and cleared again; the hook stays,
    and runs once the parameter is unfrozen.
    """
    if param.requires_grad:
        return param.register_post_accumulate_grad_hook(hook)
    param.requires_grad_(True)
    try:
        return param.register_post_accumulate_grad_hook(hook)
    finally:
        param.requires_grad_(False)


def ready_hook_first(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
    """``ready_hook``, run before the hooks ``param`` has already (someone else's, which
    then see the ``.grad`` the reducer leaves, as they did before)."""
    handle = ready_hook(param, hook)
    # Reinserted, not move_to_end: torch runs them in the order of the underlying dict.
    hooks: dict[int, Any] = param._post_accumulate_grad_hooks
    others = [(k, h) for k, h in hooks.items() if k != handle.id]
    hooks.clear()
    hooks[handle.id] = hook
    hooks.update(others)
    return handle


def when_given(hook: Callable[[int, torch.Tensor], None], i: int, param: torch.Tensor) -> None:
    """Call ``hook(i, param)`` unless ``param`` has no gradient after all.

    A parameter's hook also runs when the graph reached it but gave it no gradient: an
    autograd Function whose backward returns None for it. With
    ``find_unused_parameters`` torch DDP counts such a parameter as unused on this rank,
    and leaves its ``.grad`` None when no rank gave it one: so does skipping the hook.
    """
    if param.grad is not None:
        hook(i, param)
