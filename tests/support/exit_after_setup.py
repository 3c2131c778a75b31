"""A Fabric script that ends right after ``fabric.setup``: run by torchrun in test_exit.py.

The watchdog's thread has then just started its first store call; the process must still
exit 0, not by SIGABRT ("terminate called without an active exception").
"""

from __future__ import annotations

import torch
from lightning.fabric import Fabric

import bucketddp  # noqa: F401  (registers "bucket_ddp")

torch.set_num_threads(1)
fabric = Fabric(accelerator="cpu", devices=2, strategy="bucket_ddp")
fabric.launch()
fabric.setup(torch.nn.Linear(4, 4))
