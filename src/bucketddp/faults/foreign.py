"""Whether the main thread sits in a ``torch.distributed`` collective, and whose.

A collective bucketddp did not launch (a user's, or Lightning 2.6's SIGTERM handler's
``dist.broadcast``) leaves no progress mark, so the stall report would call that rank busy
"in forward, not in a collective" while its stack shows it waiting. The watchdog reads the
main thread's Python frames instead: the outermost frame inside ``torch.distributed``
names the collective, and the frame that called it names the caller.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch.distributed

_TORCH_DIST = os.path.dirname(torch.distributed.__file__) + os.sep
_BUCKETDDP = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_C10D = os.sep + "distributed_c10d.py"
_MAX_FRAMES = 200


def _module(frame: FrameType) -> bool:
    return frame.f_code.co_name == "<module>"


def collective_of(thread_id: int | None) -> tuple[str, bool] | None:
    """(what the thread ``thread_id`` waits in, in words; whether bucketddp called it), if
    its innermost Python frames are a collective of ``torch.distributed``; else None."""
    if thread_id is None:
        return None
    frame: FrameType | None = sys._current_frames().get(thread_id)
    # The collectives' own module, inside a function (not importing torch.distributed).
    if frame is None or not frame.f_code.co_filename.endswith(_C10D) or _module(frame):
        return None
    name = frame.f_code.co_name
    for _ in range(_MAX_FRAMES):
        caller = frame.f_back
        if caller is None:
            return None
        if not caller.f_code.co_filename.startswith(_TORCH_DIST):
            code = caller.f_code
            ours = code.co_filename.startswith(_BUCKETDDP)
            where = f"{code.co_filename}:{caller.f_lineno} ({code.co_name})"
            return f"in torch.distributed.{name}, called from {where}", ours
        frame = caller
        if frame.f_code.co_name != "wrapper":  # c10d_logger's decorator
            name = frame.f_code.co_name
    return None
