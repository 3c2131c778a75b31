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


finished = [False]  # the callback ran to its end (with bucketddp: before the shutdown)


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
    finished[0] = True
    return future.value()


class _Linger:
    """Holds the interpreter's shutdown open (its module is cleared then) until the
    callback has run to its end, with a hang guard. Torch alone: the worker, waking from
    its sleep while the interpreter finalizes, ends the process by SIGABRT in this window,
    however long a loaded machine takes to schedule it. With bucketddp, the callback ended
    before the shutdown began, and this returns at once."""

    def __init__(self) -> None:
        self.sleep, self.clock, self.finished = time.sleep, time.monotonic, finished

    def __del__(self) -> None:
        deadline = self.clock() + 60.0  # a hang guard
        while not self.finished[0] and self.clock() < deadline:
            self.sleep(0.01)  # releases the GIL: the worker's wake-up comes in this window


_linger = _Linger()
chained = dist.all_reduce(tensor, async_op=True).get_future().then(callback)
while not started.exists():
    time.sleep(0.001)
started.unlink()
