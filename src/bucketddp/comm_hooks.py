"""Communication hooks: torch DDP's ``register_comm_hook`` contract, for our buckets.

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``. It receives a bucket's
flat gradient buffer, not yet averaged, launches whatever communication it likes, and
returns a future whose value is the reduced buffer. The hooks in
``torch.distributed.algorithms.ddp_comm_hooks`` (``allreduce_hook``, ``fp16_compress_hook``,
the PowerSGD hooks, the compression wrappers) take the :class:`GradBucket` below as they
take torch's own ``dist.GradBucket``.

A hook may launch collectives from its futures' callbacks (PowerSGD does), and on gloo
those callbacks run on the process group's own threads, whenever the previous collective
happens to finish. Were the next bucket's hook called meanwhile from the backward pass, the
ranks could issue their collectives in different orders: a collective mismatch, or a hang.
Such a hook is *ordered*: each bucket's call waits until the previous bucket's future is
done (:func:`call_after`), which keeps one order on every rank. Every other hook is called
as soon as its bucket is full, so its buckets' communication overlaps as without a hook.

:func:`launches_from_callbacks` tells which is which. A hook declares it with an attribute,
``hook.launches_from_callbacks = True`` or ``False``; torch's hooks that launch only when
called (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
``post_localSGD_hook``) are known without one. Any other hook, PowerSGD and torch's
compression wrappers included, counts as ordered: a hook wrongly taken as unordered could
hang or abort the job, while one wrongly taken as ordered only launches later.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# The bucket is typed Any: torch's hooks are annotated with ``dist.GradBucket``, and they
# take the GradBucket below at run time just as well.
CommHook = Callable[[Any, Any], "torch.futures.Future[Any]"]


DECLARED = "launches_from_callbacks"
"""The attribute by which a hook says whether it launches collectives from its futures'
callbacks (True: its buckets' calls must keep one order) or only when called (False)."""

_TORCH_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks."
CALLER_ONLY = {
    _TORCH_HOOKS + "default_hooks": ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"),
    _TORCH_HOOKS + "post_localSGD_hook": ("post_localSGD_hook",),
}
"""torch's hooks that launch every collective when called, never from a callback, by
module. (Looked up where already imported: a program holding one has imported its module.)"""


AVERAGING: dict[str, dict[str, torch.dtype | None]] = {
    _TORCH_HOOKS + "default_hooks": {
        "allreduce_hook": None,
        "fp16_compress_hook": torch.float16,
        "bf16_compress_hook": torch.bfloat16,
    },
}
"""torch's hooks that average the whole buffer elementwise over their group, by module, with
the dtype they average in (None: the buffer's own)."""


def averaging_wire(hook: CommHook, buffer_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype in which ``hook`` averages a ``buffer_dtype`` buffer elementwise over its
    group, if it is one of the hooks in ``AVERAGING``; None for any other hook."""
    for module, hooks in AVERAGING.items():
        loaded = sys.modules.get(module)
        if loaded is None:
            continue
        for name, wire in hooks.items():
            if getattr(loaded, name, None) is hook:
                return buffer_dtype if wire is None else wire
    return None


POWERSGD = _TORCH_HOOKS + "powerSGD_hook"
"""The module of torch's ``powerSGD_hook``: a hook that averages each 1-D gradient of a
bucket elementwise, uncompressed, with the buffer's dtype (``row_in_powersgd``)."""


def row_in_powersgd(hook: CommHook, state: Any) -> bool:
    """Whether ``hook`` is torch's ``powerSGD_hook`` with a ``state`` under which a trailing
    1-D tensor in ``GradBucket.gradients()`` is averaged elementwise, never compressed.

    PowerSGD sends a gradient uncompressed when ``(n + m) * rank * min_compression_rate``
    is not below ``n * m``; for an ``n x 1`` tensor that holds for every ``n`` once
    ``min_compression_rate >= 1`` (torch's default is 2) and ``rank >= 1``. Its vanilla
    steps (before ``start_powerSGD_iter``) average the whole buffer. (``batched_powerSGD_hook``
    compresses the whole buffer: it is not taken.)
    """
    module = sys.modules.get(POWERSGD)
    if module is None or getattr(module, "powerSGD_hook", None) is not hook:
        return False
    return (
        isinstance(state, module.PowerSGDState)
        and state.min_compression_rate >= 1
        and state.matrix_approximation_rank >= 1
    )


def fit_row_error(state: Any, index: int, numel: int, full: int, rides: bool) -> None:
    """Fit PowerSGD's error feedback for bucket ``index`` to the buffer its hook gets next:
    ``numel`` gradients, then up to ``full`` elements the agreement row when it ``rides``.

    PowerSGD keeps, per bucket, what this rank's buffer lost in the step (its value minus
    what came back) and adds it to the next step's buffer. For an averaged gradient that is
    this rank's share of the ranks' difference; for the row it must be nothing, or the next
    step's row would carry this one's: its part is zeroed. An entry of the other length (a
    checkpoint from a run where the row rode, or went alone) is cut or padded with zeros;
    the gradients' part is kept. An entry of any other length is left to PowerSGD.
    """
    error = state.error_dict.get(index) if state.use_error_feedback else None
    if error is None or error.numel() not in (numel, full):
        return
    if not rides:
        if error.numel() != numel:
            state.error_dict[index] = error[:numel]
    elif error.numel() == full:
        error[numel:].zero_()
    else:
        state.error_dict[index] = torch.cat([error, error.new_zeros(full - numel)])


def averages_exactly(wire: torch.dtype, world_size: int) -> bool:
    """Whether ``world_size`` ranks' 0/1 flags, averaged in ``wire`` and multiplied back by
    ``world_size``, round to their exact sum.

    Each of the ``world_size`` quotients and partial sums rounds by at most half an ulp of a
    value at most 1, so the sum is off by at most ``world_size * eps``, and by
    ``world_size**2 * eps`` once multiplied back; below 1/4 it rounds right, with margin.
    """
    if not wire.is_floating_point:
        return False
    return world_size * world_size * torch.finfo(wire).eps < 0.25


def launches_from_callbacks(hook: CommHook) -> bool:
    """Whether ``hook`` may launch collectives from its futures' callbacks (see above).

    Its own ``launches_from_callbacks`` attribute if it has one; else False for the torch
    hooks in ``CALLER_ONLY``, and True for any other hook: the safe default.
    """
    declared = getattr(hook, DECLARED, None)
    if declared is not None:
        return bool(declared)
    for module, names in CALLER_ONLY.items():
        loaded = sys.modules.get(module)
        if loaded is not None and any(getattr(loaded, n, None) is hook for n in names):
            return False
    return True


class GradBucket:
    """One bucket as a communication hook sees it (the methods of ``dist.GradBucket``)."""

    __slots__ = ("_buffer", "_gradients", "_index", "_last", "_parameters")

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        gradients: Callable[[], list[torch.Tensor]],
        parameters: list[nn.Parameter],
        last: bool,
    ) -> None:
        """``gradients`` makes the views ``gradients()`` returns, on its first call only:
        most hooks never ask for them."""
        self._index = index
        self._buffer = buffer
        self._gradients: Callable[[], list[torch.Tensor]] | list[torch.Tensor] = gradients
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
        if callable(self._gradients):
            self._gradients = self._gradients()
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
