"""A process group that forms reliably after torchrun restarts its workers.

Under torchrun the workers' store is the agent's, which outlives them. Its keys keep the
last attempt's entries, gloo's addresses among them, so a restarted group can read a dead
worker's address before the new worker has written its own, and fail with "Connection
refused". Each attempt gets a key namespace of its own here.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .job import under_torchrun

DEFAULT_TIMEOUT = timedelta(minutes=30)


def uses_agent_store() -> bool:
    """Whether this worker's process group would use torchrun's agent store."""
    return under_torchrun() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def agent_store(timeout: timedelta = DEFAULT_TIMEOUT) -> dist.TCPStore:
    """A client of torchrun's agent store (which outlives the workers)."""
    env = os.environ
    return dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        is_master=False,
        timeout=timeout,
        wait_for_workers=False,
    )


def attempt_store(timeout: timedelta = DEFAULT_TIMEOUT) -> dist.Store:
    """A client of torchrun's agent store whose keys are this attempt's alone."""
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    return dist.PrefixStore(f"bucketddp/attempt/{attempt}", agent_store(timeout))


def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` that forms its group after torchrun restarts.

    Under torchrun, the group uses the agent's store with a key namespace per attempt;
    anywhere else this is ``init_process_group(backend, **kwargs)`` itself.
    """
    if not uses_agent_store() or "store" in kwargs or "init_method" in kwargs:
        dist.init_process_group(backend, **kwargs)
        return
    timeout = kwargs.pop("timeout", None) or DEFAULT_TIMEOUT
    dist.init_process_group(
        backend,
        store=attempt_store(timeout),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
        **kwargs,
    )
