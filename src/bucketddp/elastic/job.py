"""Who this process is in an elastic job: torchrun's run, attempt, node and ranks.

torchrun's agent tells its workers their place through environment variables: the run id
(the same on every node and every restart), the restart count and the restarts allowed,
the node's rank in this attempt (``GROUP_RANK``) and the ranks. Snapshots are named by
the run, so that two jobs on one node never mix, and by attempt and node, so that the
files of a node that left are told from this one's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = "/dev/shm"
"""Node-local shared memory: survives the worker processes, not the node."""


NOT_UNDER_TORCHRUN = (
    "bucketddp: elastic training takes no snapshots in this run: it needs torchrun, whose "
    "agent restarts the workers after a failure (torchrun --max-restarts=N ...); no other "
    "launcher restarts them, Lightning's own included. To resume from a file instead, save "
    "checkpoints and load one (ckpt_path=...)."
)


def under_torchrun() -> bool:
    """Whether this process was started by torchrun's elastic agent."""
    return "TORCHELASTIC_RESTART_COUNT" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ


@dataclass(frozen=True)
class Job:
    """This process's place in an elastic job."""

    run_id: str
    attempt: int
    node: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    max_restarts: int | None = None  # the restarts torchrun allows (None: not told)

    @property
    def last_attempt(self) -> bool:
        """Whether torchrun's agent will restart no more: this attempt is its last."""
        return self.max_restarts is not None and self.attempt >= self.max_restarts

    @classmethod
    def from_env(cls) -> Job:
        """The job as torchrun describes it (raises ``RuntimeError`` outside torchrun)."""
        if not under_torchrun():
            raise RuntimeError(
                "elastic training needs torchrun (its agent restarts the workers and tells "
                "them their place); start the script with torchrun --max-restarts=N ..."
            )
        env = os.environ
        return cls(
            run_id=env["TORCHELASTIC_RUN_ID"],
            attempt=int(env["TORCHELASTIC_RESTART_COUNT"]),
            node=int(env.get("GROUP_RANK", "0")),
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            max_restarts=int(env["TORCHELASTIC_MAX_RESTARTS"])
            if "TORCHELASTIC_MAX_RESTARTS" in env
            else None,
        )

    def directory(self) -> Path:
        """This job's snapshot folder on this node: ``<root>/bucketddp-<uid>/<run id>``, the
        root ``BUCKETDDP_SNAPSHOT_DIR`` or /dev/shm. The per-user parent is private, so no
        other user can make or see a job's folder (``folder.py`` checks both)."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.run_id)[:100].lstrip(".") or "_"
        return user_folder() / safe


def user_folder(root: str | Path | None = None) -> Path:
    """This user's snapshot folder, ``<root>/bucketddp-<uid>``: the root ``root``, else
    ``BUCKETDDP_SNAPSHOT_DIR``, else /dev/shm."""
    base = root if root is not None else os.environ.get("BUCKETDDP_SNAPSHOT_DIR", DEFAULT_ROOT)
    return Path(base) / f"bucketddp-{os.geteuid()}"
