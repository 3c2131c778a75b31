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

from ..comm import wait_kept
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
    dtype = found[0]

    def average(buffer: torch.Tensor) -> Averaged:
        # The default group is looked up at each call, as torch's hooks do.
        group = state if state is not None else dist.group.WORLD
        wire = buffer if dtype is None else buffer.to(dtype)
        wire.div_(dist.get_world_size(group))
        return Averaged(dist.all_reduce(wire, group=group, async_op=True), buffer, wire)

    return average
