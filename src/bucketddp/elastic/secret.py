"""The job's key: a secret that only the job's ranks hold, which authenticates its metas.

A meta holds pickled state (``files.py``), so a rank unpickles only a meta whose HMAC
checks with this key. The key is a random 256-bit secret kept in torchrun's agent store,
which outlives the workers: every attempt of the job finds the same key there. Each node
also keeps a copy in its private snapshot folder (file ``key``, mode ``0600``), for when
the store is a new one (the node that held it was lost, or the job was started again):
the first node to offer its copy gives the job its key, or a new one is drawn. A stop's
snapshot on disk (``disk.py``) keeps a copy too, offered when the node's folder has none:
a job started again on other nodes reads its disk snapshot with it. So a key lives as
long as the job's store or one of its snapshot folders, and no longer.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import torch.distributed as dist

from .folder import Folder
from .group import agent_store, uses_agent_store
from .job import Job

KEY_FILE = "key"


def _store() -> dist.Store:
    """The store the job's ranks share across restarts: torchrun's agent store, or (where
    the workers make their own) the default group's."""
    if uses_agent_store():
        return agent_store()
    return dist.distributed_c10d._get_default_store()


def _valid(kept: str) -> bool:
    return len(kept) == 64 and all(c in "0123456789abcdef" for c in kept)


def _offer(folder: Folder, other: Callable[[], str] | None) -> str:
    """This node's copy of the key, else ``other()``'s (the disk copy), else a new one."""
    try:
        kept = folder.read(KEY_FILE).decode("ascii")
    except (OSError, UnicodeDecodeError):
        kept = ""
    if not _valid(kept) and other is not None:
        kept = other()
    return kept if _valid(kept) else secrets.token_hex(32)


def job_key(job: Job, folder: Folder, other: Callable[[], str] | None = None) -> bytes:
    """This job's key, agreed through the store (not a collective: each rank asks the store;
    each node's first rank offers its copy, else ``other()``'s, and keeps the agreed one)."""
    store = _store()
    name = f"bucketddp/snapshot-key/{job.run_id}"
    if job.local_rank != 0:
        return bytes.fromhex(store.get(name).decode("ascii"))
    offered = _offer(folder, other)
    agreed = store.compare_set(name, "", offered).decode("ascii")
    if agreed != offered or KEY_FILE not in folder.names():
        folder.write(KEY_FILE, agreed.encode("ascii"))
    return bytes.fromhex(agreed)
