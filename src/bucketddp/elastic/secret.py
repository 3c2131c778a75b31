"""The job's key: a secret that only the job's ranks hold, which authenticates its metas.

A meta holds pickled state (``files.py``), so a rank unpickles only a meta whose HMAC
checks with this key. The key is a random 256-bit secret kept in torchrun's agent store,
which outlives the workers: every attempt of the job finds the same key there. Each node
also keeps a copy in its private snapshot folder (file ``key``, mode ``0600``), for when
the store is a new one (the node that held it was lost, the job was started again, or the
workers make their own store each round, as when a node joins): a node's kept copy wins
over a new key, so a joining node, which has none, never hides the others' snapshots; a
new key is drawn only when no node kept one. A stop's snapshot on disk (``disk.py``) keeps
a copy too, offered when the node's folder has none: a job started again on other nodes
reads its disk snapshot with it. So a key lives as long as the job's store or one of its
snapshot folders, and no longer.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from .folder import Folder
from .group import agent_store, uses_agent_store
from .job import Job

KEY_FILE = "key"
POST_TIMEOUT = timedelta(minutes=5)  # for every node's first rank to post its kept key


def _store() -> dist.Store:
    """The store the job's ranks share across restarts: torchrun's agent store, or (where
    the workers make their own) the default group's."""
    if uses_agent_store():
        return agent_store()
    return dist.distributed_c10d._get_default_store()


def _valid(kept: str) -> bool:
    return len(kept) == 64 and all(c in "0123456789abcdef" for c in kept)


def _kept(folder: Folder, other: Callable[[], str] | None) -> str:
    """This node's copy of the key, else ``other()``'s (the disk copy), else ``""``."""
    try:
        kept = folder.read(KEY_FILE).decode("ascii")
    except (OSError, UnicodeDecodeError):
        kept = ""
    if not _valid(kept) and other is not None:
        kept = other()
    return kept if _valid(kept) else ""


def _offer(store: dist.Store, name: str, job: Job, kept: str) -> str:
    """What this node offers as the job's key: a kept copy, this node's or (when it has
    none) the first node's that has one; else a new key. A node that joins a running job
    has no copy, and must not win over the nodes that hold the snapshots: with several
    nodes, each one's first rank posts what it kept, and waits for every node's post."""
    if job.nodes is None or job.nodes < 2 or store.check([name]):
        return kept or secrets.token_hex(32)  # with the key agreed already, it is that
    # Not by attempt: torchrun counts restarts per agent, and a joining agent's count is 0.
    posts = f"{name}/kept"
    store.set(f"{posts}/{job.node}", kept or "-")
    keys = [f"{posts}/{node}" for node in range(job.nodes)]
    try:
        store.wait(keys, POST_TIMEOUT)
    except Exception as e:
        missing = [n for n, k in enumerate(keys) if not store.check([k])]
        raise RuntimeError(
            f"bucketddp: the first rank of node(s) {missing} did not offer the job's snapshot "
            f"key within {POST_TIMEOUT}; has a node failed to start? ({e})"
        ) from None
    found = [v for v in (store.get(k).decode("ascii") for k in keys) if _valid(v)]
    return found[0] if found else secrets.token_hex(32)


def job_key(job: Job, folder: Folder, other: Callable[[], str] | None = None) -> bytes:
    """This job's key, agreed through the store (not a collective: each rank asks the store;
    each node's first rank offers a kept copy, its own or ``other()``'s, in preference to a
    new one (``_offer``), and keeps the agreed one)."""
    store = _store()
    name = f"bucketddp/snapshot-key/{job.run_id}"
    if job.local_rank != 0:
        return bytes.fromhex(store.get(name).decode("ascii"))
    kept = _kept(folder, other)
    agreed = store.compare_set(name, "", _offer(store, name, job, kept)).decode("ascii")
    if agreed != kept or KEY_FILE not in folder.names():
        folder.write(KEY_FILE, agreed.encode("ascii"))
    return bytes.fromhex(agreed)
