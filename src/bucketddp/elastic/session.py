"""One process's part in elastic training: snapshots out at step boundaries, resume in.

The Trainer and Fabric strategies and the plain-loop helper each hold one ``Session``. It
knows the job (``job.py``), writes this rank's share of every ``every``-th snapshot
(``snapshots.py``), restores the newest one after a restart (``resume.py``), keeps at most
two snapshots per node, and removes them on a clean finish.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .files import remove, scan
from .job import Job
from .resume import Restored, keep_only, restore
from .snapshots import Writer


def check_every(every: object) -> int:
    """``every`` as a positive number of steps, or a ValueError naming it."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"snapshot_every must be a positive number of steps, got {every!r}")
    return every


class Session:
    """Snapshots and resume for this process (needs torchrun; see ``Job.from_env``)."""

    def __init__(self, every: int = 1, group: dist.ProcessGroup | None = None) -> None:
        self.every = check_every(every)
        self.job = Job.from_env()
        self.group = group
        self._writer: Writer | None = None
        self._older_attempts_left = self.job.attempt > 0

    def due(self, step: int) -> bool:
        """Whether a snapshot is due after ``step`` steps."""
        return step % self.every == 0

    def take(self, step: int, state: Any, own: Any = None) -> None:
        """Write this rank's share of the snapshot of ``step`` (the write finishes in the
        background); ``own`` is this rank's own part (RNG states, rank-local buffers)."""
        if self._writer is None:
            self._writer = Writer(self.job, self.job.directory())
        self._writer.take(step, state, own)
        if self._older_attempts_left and self.job.local_rank == 0:
            self._drop_older_attempts()

    def _drop_older_attempts(self) -> None:
        # Once this attempt has a complete snapshot on this node, the last attempt's are done.
        found = scan(self.job.directory())
        if not any(s.attempt == self.job.attempt for s in found):
            return
        for s in found:
            if s.attempt < self.job.attempt:
                for meta in s.metas.values():
                    remove(Path(meta["path"]))
                    remove(Path(meta["path"]).with_suffix(".data"))
        self._older_attempts_left = False

    def restore(self) -> Restored | None:
        """The newest readable snapshot of this job, agreed on and sent to every rank; None
        when there is none. A collective."""
        restored = restore(self.job, self.group)
        if restored is not None:
            keep_only(self.job, restored.step)
        elif self.job.attempt > 0 and self.job.rank == 0:
            print(
                f"bucketddp: attempt {self.job.attempt} of this job found no usable snapshot "
                "on any node: training starts from the beginning",
                file=sys.stderr,
                flush=True,
            )
        return restored

    def finish(self) -> None:
        """A clean finish: wait for this rank's writes, then remove the job's snapshots on
        this node. A collective."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if dist.is_initialized():
            dist.barrier(group=self.group)
        if self.job.local_rank == 0:
            shutil.rmtree(self.job.directory(), ignore_errors=True)
