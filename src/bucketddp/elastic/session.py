"""One process's part in elastic training: snapshots out at step boundaries, resume in.

The Trainer and Fabric strategies and the plain-loop helper each hold one ``Session``. It
knows the job (``job.py``), opens and checks the node's private snapshot folder
(``folder.py``) and gets the job's key (``secret.py``), writes this rank's share of every
``every``-th snapshot (``snapshots.py``), restores the newest one after a restart
(``resume.py``), keeps at most two snapshots per node, and removes them on a clean finish.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

from .files import data_name, scan
from .folder import Folder, UnsafeFolder
from .job import Job
from .resume import Restored, keep_only, restore
from .secret import job_key
from .snapshots import Writer

FIX = "set BUCKETDDP_SNAPSHOT_DIR to a folder of your own"


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
        self._folder: Folder | None = None
        self._key: bytes | None = None
        self._older_attempts_left = self.job.attempt > 0

    def _open_folder(self) -> Folder:
        """This node's checked snapshot folder, under the per-user parent (``Job``); raises
        ``UnsafeFolder``."""
        if self._folder is None:
            try:
                self._folder = Folder.open(self.job.directory(), private=2)
            except UnsafeFolder as e:
                raise UnsafeFolder(
                    f"bucketddp: refusing the snapshot folder: {e} ({FIX})"
                ) from None
        return self._folder

    def _open(self) -> tuple[Folder, bytes]:
        """The checked folder and the job's key."""
        folder = self._open_folder()
        if self._key is None:
            self._key = job_key(self.job, folder)
        return folder, self._key

    def due(self, step: int) -> bool:
        """Whether a snapshot is due after ``step`` steps."""
        return step % self.every == 0

    def take(self, step: int, state: Any, own: Any = None) -> None:
        """Write this rank's share of the snapshot of ``step`` (the write finishes in the
        background); ``own`` is this rank's own part (RNG states, rank-local buffers)."""
        if self._writer is None:
            self._writer = Writer(self.job, *self._open())
        self._writer.take(step, state, own)
        if self._older_attempts_left and self.job.local_rank == 0:
            self._drop_older_attempts()

    def _drop_older_attempts(self) -> None:
        # Once this attempt has a complete snapshot on this node, the last attempt's are done.
        folder, key = self._open()
        found = scan(folder, key)
        if not any(s.attempt == self.job.attempt for s in found):
            return
        for s in found:
            if s.attempt < self.job.attempt:
                for meta in s.metas.values():
                    folder.remove(meta["name"])
                    folder.remove(data_name(meta["name"]))
        self._older_attempts_left = False

    def check_folders(self) -> None:
        """Check this node's snapshot folder, and agree: if any rank's fails its check,
        every rank raises ``UnsafeFolder`` naming it. A collective."""
        problem = None
        try:
            self._open_folder()
        except UnsafeFolder as e:
            problem = f"rank {self.job.rank} (node {self.job.node}): {e}"
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, problem, group=self.group)
        found = [p for p in everyone if p is not None]
        if found:
            raise UnsafeFolder("\n".join(found))

    def restore(self) -> Restored | None:
        """The newest readable snapshot of this job, agreed on and sent to every rank; None
        when there is none. A collective; first checks every rank's folder
        (``check_folders``)."""
        self.check_folders()
        folder, key = self._open()
        restored = restore(self.job, folder, key, self.group)
        if restored is not None:
            keep_only(self.job, folder, key, restored.step)
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
            self._open_folder().remove_all()
        if self._folder is not None:
            self._folder.close()
            self._folder = None
