"""Communication hooks: torch DDP's ``register_comm_hook`` contract, for our buckets.

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``. It receives a bucket's
flat gradient buffer, not yet averaged, launches whatever communication it likes, and
returns a future whose value is the reduced buffer. The hooks in
``torch.distributed.algorithms.ddp_comm_hooks`` (``allreduce_hook``, ``fp16_compress_hook``,
the PowerSGD hooks, the compression wrappers) take the :class:`GradBucket` below as they
take torch's own ``dist.GradBucket``.

Each bucket's hook is called only once the previous bucket's future is done
(:func:`call_after`). A hook may launch collectives from its futures' callbacks (PowerSGD
does), and on gloo those callbacks run on the process group's own threads, whenever the
previous collective happens to finish. Were the next bucket's hook called meanwhile from
the backward pass, the ranks could issue their collectives in different orders: a
collective mismatch, or a hang. Waiting for the previous future keeps one order on every
rank. Where futures complete at launch (NCCL), the next hook is called at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# The bucket is typed Any: torch's hooks are annotated with ``dist.GradBucket``, and they
# take the GradBucket below at run time just as well.
CommHook = Callable[[Any, Any], "torch.futures.Future[Any]"]


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


def call_after(
    previous: torch.futures.Future[Any], call: Callable[[], torch.futures.Future[Any]]
) -> torch.futures.Future[Any]:
    """Make ``call()`` once ``previous`` is done; returns a future of what ``call()``'s holds.

    ``call`` runs on the thread that completes ``previous`` (at once, here, if it already
    is). An exception from ``call`` or from its future ends up in the returned future.
    """
    result: torch.futures.Future[Any] = torch.futures.Future()

    def forward(done: torch.futures.Future[Any]) -> None:
        try:
            result.set_result(done.value())
        except Exception as e:  # handed to whoever waits on ``result``
            result.set_exception(e)

    def start(_: torch.futures.Future[Any]) -> None:
        try:
            inner = call()
        except Exception as e:  # handed to whoever waits on ``result``
            result.set_exception(e)
            return
        inner.add_done_callback(forward)

    previous.add_done_callback(start)
    return result


def hook_result(value: Any, buffer: torch.Tensor, hook: CommHook) -> torch.Tensor:
    """The reduced tensor in a hook's future ``value``, checked against the bucket's buffer.

    torch DDP accepts a tensor or a one-tensor list (what a collective's future holds).
    A collective on a complex buffer runs on its real view (``torch.view_as_real``), and
    its future holds that view: it is taken as the complex buffer it shows.
    """
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if (
        isinstance(value, torch.Tensor)
        and buffer.is_complex()
        and value.dtype == buffer.real.dtype
        and value.numel() == 2 * buffer.numel()
    ):
        value = torch.view_as_complex(value.reshape(-1, 2))
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
