"""A script whose gloo worker runs Python as the interpreter shuts down.

    python exit_callback.py PORT none|bucketddp [STARTED_FILE]

One process, a gloo group of one. The script's last collective gets a ``then`` callback
(as bucketddp's step clock and torch's comm hooks add) that is still running, with the GIL
released, when the main thread reaches the end of the script. Without bucketddp's exit
handler the worker asks for the GIL during interpreter shutdown and the process ends by
SIGABRT ("terminate called without an active exception"); with ``bucketddp`` imported it
exits 0. The callback writes a file when it starts, so the main thread ends only once the
worker is inside Python: the order is an event, not a guess.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

MODE = sys.argv[2]
if MODE == "bucketddp":
    import bucketddp  # its exit handler is the thing under test

started = Path(sys.argv[3] if len(sys.argv) > 3 else f"/tmp/exit-callback-{os.getpid()}")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
tensor = torch.ones(4)


def callback(future: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
    started.touch()
    # Run Python until the interpreter shuts down (torch alone: this thread then dies in
    # pthread_exit, and the process by SIGABRT), or until bucketddp's exit handler waits
    # for this thread (then finish, and the process exits 0). Both are events.
    deadline = time.monotonic() + 60.0  # a hang guard
    while time.monotonic() < deadline and not sys.is_finalizing():
        if MODE == "bucketddp" and bucketddp.clean_exit.waiting:
            time.sleep(0.05)
            break
        time.sleep(0.001)
    return future.value()


class _Linger:
    """Keeps the interpreter's shutdown going for a while after it began (its module is
    cleared then), so that the worker, woken from its sleep, asks for the GIL while the
    interpreter is finalizing even on a loaded machine, where it might otherwise not be
    scheduled before the process is gone (and torch alone would exit 0)."""

    def __init__(self) -> None:
        self.sleep = time.sleep

    def __del__(self) -> None:
        self.sleep(2.0)  # releases the GIL: the worker's wake-up comes in this window


_linger = _Linger()
chained = dist.all_reduce(tensor, async_op=True).get_future().then(callback)
while not started.exists():
    time.sleep(0.001)
started.unlink()
