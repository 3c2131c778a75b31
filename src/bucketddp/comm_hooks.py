"""Communication hooks: torch DDP's ``register_comm_hook`` contract, for our buckets.

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``. It receives a bucket's
flat gradient buffer, not yet averaged, launches whatever communication it likes, and
returns a future whose value is the reduced buffer. The hooks in
``torch.distributed.algorithms.ddp_comm_hooks`` (``allreduce_hook``, ``fp16_compress_hook``,
the PowerSGD hooks, the compression wrappers) take the :class:`GradBucket` below as they
take torch's own ``dist.GradBucket``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

CommHook = Callable[[Any, "GradBucket"], "torch.futures.Future[Any]"]


class GradBucket:
    """One bucket as a communication hook sees it (the methods of ``dist.GradBucket``)."""

    __slots__ = ("_buffer", "_gradients", "_index", "_last", "_parameters")

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        gradients: list[torch.Tensor],
        parameters: list[nn.Parameter],
        last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._gradients = gradients
        self._parameters = parameters
        self._last = last

    def index(self) -> int:
        """The bucket's position in launch order (0 is launched first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D buffer of the bucket's local gradients, not yet averaged."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the tensor ``buffer()`` returns."""
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """The bucket's gradients, each a view into the buffer, shaped like its parameter."""
        return self._gradients

    def parameters(self) -> list[nn.Parameter]:
        """The bucket's parameters, in the order of ``gradients()``."""
        return self._parameters

    def is_last(self) -> bool:
        """Whether this is the last bucket launched in the step."""
        return self._last


def run_hook(hook: CommHook, state: Any, bucket: GradBucket) -> torch.futures.Future[Any]:
    """Call ``hook`` on ``bucket``; raise a TypeError naming the hook if it returns no future."""
    fut = hook(state, bucket)
    # Collectives' futures are torch._C.Future, the base of torch.futures.Future.
    if not callable(getattr(fut, "wait", None)):
        raise TypeError(
            f"communication hook {getattr(hook, '__name__', hook)!r} returned "
            f"{type(fut).__name__}; it must return a torch.futures.Future holding the reduced "
            "buffer (for example dist.all_reduce(..., async_op=True).get_future())"
        )
    return fut


def hook_result(value: Any, buffer: torch.Tensor, hook: CommHook) -> torch.Tensor:
    """The reduced tensor in a hook's future ``value``, checked against the bucket's buffer.

    torch DDP accepts a tensor or a one-tensor list (what a collective's future holds).
    """
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor) or value.numel() != buffer.numel():
        shown = (
            f"a tensor of {value.numel()} elements"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise RuntimeError(
            f"communication hook {getattr(hook, '__name__', hook)!r}: its future holds "
            f"{shown}, but the bucket's buffer has {buffer.numel()} elements; the future must "
            "hold the reduced buffer"
        )
    return value
