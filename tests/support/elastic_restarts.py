"""A torchrun job whose group must form after every restart: run by test_elastic.py.

Each attempt before the last forms its group, checks it with an all-reduce, and then one
rank kills itself (SIGKILL), so torchrun restarts every worker. Every attempt appends
"formed <attempt>" to ``<out>/formed.rank<R>``; the last one exits 0.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from bucketddp.elastic import init_process_group

torch.set_num_threads(1)
out, last = sys.argv[1], int(sys.argv[2])
init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
total = torch.ones(1)
dist.all_reduce(total)
assert total.item() == dist.get_world_size()
with open(f"{out}/formed.rank{rank}", "a") as f:
    print(f"formed {attempt}", file=f, flush=True)
if attempt < last:
    if rank == attempt % dist.get_world_size():
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)  # until torchrun ends this attempt, however long it takes to notice
dist.destroy_process_group()
