"""torch's averaging hooks, run by the reducer itself: no Python on the backend's thread.

torch's ``allreduce_hook`` divides a bucket's buffer by its group's size, all-reduces it,
and returns the collective's future chained with a Python callback that hands the buffer
back; ``fp16_compress_hook`` and ``bf16_compress_hook`` divide a copy in the narrower
dtype, all-reduce that, and copy it back into the buffer in such a callback. On gloo the
callback runs on the backend's thread, which must take the GIL; in bucketddp the GIL is
often held by the backward's Python gradient hooks or the end of the backward, so the
callback, and the step waiting on it, waits too. torch DDP's C++ reducer holds no GIL in
its backward and does not pay this.

Registered as the hook itself (the same function object), such a hook runs here instead:
the same division and the same all-reduce on the same group, in the same order, and the
same copy back, made when the reducer waits for the bucket; so the result is the same to
the bit, with no callback. Any other hook, a wrapper of one of these included, is called
as registered.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..comm import AsyncSum, on_wire, wait_kept
from ..comm_hooks import AVERAGING, CommHook


class Averaged:
    """A bucket's average under way: what the reducer waits on in place of a hook's future.

    ``done()`` says whether the all-reduce finished; ``wait()`` waits for it, copies a
    narrower wire's result back into the buffer, and returns the buffer, which then holds
    the average (what torch's hook's future holds).
    """

    __slots__ = ("_buffer", "_wire", "_work")

    def __init__(self, work: dist.Work, buffer: torch.Tensor, wire: torch.Tensor) -> None:
        self._work = work
        self._buffer = buffer
        self._wire: torch.Tensor | None = None if wire is buffer else wire

    def done(self) -> bool:
        """Whether the all-reduce has finished."""
        return bool(self._work.is_completed())

    def wait(self) -> torch.Tensor:
        """Wait for the all-reduce; returns the averaged buffer."""
        wait_kept(self._work)
        wire, self._wire = self._wire, None
        if wire is not None:
            self._buffer.copy_(wire)
        return self._buffer


class _Average:
    """Averages a buffer as torch's averaging hook with wire dtype ``dtype`` (None: the
    buffer's own) does, over ``group`` (None: the default group, looked up at each call as
    torch's hooks do). The collective is launched through the group's own ``allreduce``
    with options built once (``comm.AsyncSum``), the call ``dist.all_reduce`` makes in the
    end: its Python checks run inside the backward, where they cost most."""

    __slots__ = ("_dtype", "_group", "_size", "_state", "_sum")

    def __init__(self, state: dist.ProcessGroup | None, dtype: torch.dtype | None) -> None:
        self._state = state
        self._dtype = dtype
        self._group: dist.ProcessGroup | None = None
        self._sum: AsyncSum | None = None
        self._size = 1

    def __call__(self, buffer: torch.Tensor) -> Averaged:
        group = self._state if self._state is not None else dist.group.WORLD
        if group is not self._group or self._sum is None:
            self._sum = AsyncSum(group)
            self._group = group
            self._size = self._sum.group.size()
        wire = buffer if self._dtype is None else buffer.to(self._dtype)
        wire.div_(self._size)
        return Averaged(self._sum(on_wire(wire)), buffer, wire)


def native_hook(hook: CommHook, state: Any) -> Callable[[torch.Tensor], Averaged] | None:
    """What averages a buffer as ``hook(state, bucket)`` would, when ``hook`` is one of
    torch's averaging hooks (``comm_hooks.AVERAGING``) with a process group (or None, for
    the default group) as ``state``; None for any other hook, which is then called.
    """
    if state is not None and not isinstance(state, dist.ProcessGroup):
        return None  # torch's hook decides what to do with it
    found = [
        wire
        for module, hooks in AVERAGING.items()
        for name, wire in hooks.items()
        if getattr(sys.modules.get(module), name, None) is hook
    ]
    if not found:
        return None
    return _Average(state, found[0])
