"""Who this process is in an elastic job: torchrun's run, attempt, node and ranks.

torchrun's agent tells its workers their place through environment variables: the run id
(the same on every node and every restart), the restart count and the restarts allowed,
the node's rank in this attempt (``GROUP_RANK``) and the ranks. Snapshots are named by
the run, so that two jobs on one node never mix, and by attempt and node, so that the
files of a node that left are told from this one's.

Under SLURM without torchrun (``srun`` starts every rank), SLURM's variables say the same:
the job id (kept when the job is requeued), the requeue count, the node and the ranks.
Nothing restarts the workers in place there, so every attempt is the last for its node's
snapshots (``max_restarts=0``); a stop's snapshot reaches the requeued job on disk
(``disk.py``).
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
    "agent restarts the workers after a failure (torchrun --max-restarts=N ...), or SLURM's "
    "srun with a disk folder for a stop's snapshot (preempt_dir=..., BUCKETDDP_PREEMPT_DIR); "
    "no other launcher restarts them, Lightning's own included. To resume from a file "
    "instead, save checkpoints and load one (ckpt_path=...)."
)


def under_torchrun() -> bool:
    """Whether this process was started by torchrun's elastic agent."""
    return "TORCHELASTIC_RESTART_COUNT" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ


_SLURM_TASK = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def under_slurm() -> bool:
    """Whether this process is a SLURM task started by ``srun`` (and not by torchrun)."""
    return not under_torchrun() and all(k in os.environ for k in _SLURM_TASK)


def slurm_job_id() -> str:
    """The SLURM job's id as ``scontrol`` takes it (``<job>_<task>`` in a job array)."""
    env = os.environ
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def _tasks_on_node(spec: str, node: int) -> int:
    """Node ``node``'s task count in SLURM's ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``)."""
    counts: list[int] = []
    for part in spec.split(","):
        count, _, times = part.partition("(x")
        counts += [int(count)] * (int(times.rstrip(")")) if times else 1)
    return counts[node] if node < len(counts) else counts[-1]


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
    slurm: bool = False  # started by srun, not torchrun (``from_slurm``)
    nodes: int | None = None  # the nodes (torchrun agents) in this round, if told

    @property
    def last_attempt(self) -> bool:
        """Whether torchrun's agent will restart no more: this attempt is its last."""
        return self.max_restarts is not None and self.attempt >= self.max_restarts

    @classmethod
    def from_env(cls) -> Job:
        """The job as torchrun describes it, else as SLURM does (``under_slurm``); raises
        ``RuntimeError`` under neither."""
        if under_slurm():
            return cls.from_slurm()
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
            nodes=int(env["GROUP_WORLD_SIZE"]) if "GROUP_WORLD_SIZE" in env else None,
        )

    @classmethod
    def from_slurm(cls) -> Job:
        """The job as SLURM's variables describe it (see the module docstring)."""
        env = os.environ
        node = int(env.get("SLURM_NODEID", "0"))
        spec = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or "1"
        return cls(
            run_id=f"slurm-{slurm_job_id()}",
            attempt=int(env.get("SLURM_RESTART_COUNT", "0")),
            node=node,
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env["SLURM_LOCALID"]),
            local_world_size=_tasks_on_node(spec, node),
            max_restarts=0,
            slurm=True,
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
