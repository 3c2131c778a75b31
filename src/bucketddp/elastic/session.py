"""One process's part in elastic training: snapshots out at step boundaries, resume in.

The Trainer and Fabric strategies and the plain-loop helper each hold one ``Session``. It
knows the job (``job.py``), opens and checks the node's private snapshot folder
(``folder.py``) and gets the job's key (``secret.py``), writes this rank's share of every
``every``-th snapshot (``snapshots.py``), restores the newest one after a restart
(``resume.py``), keeps at most two snapshots per node, and removes them when the job ends
for good: on a clean finish, and at any other exit of its last attempt (``ending.py``).
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import torch.distributed as dist

from ..notice import NOTICE, Preempted, stop_signals
from . import room
from .ending import LastAttempt
from .files import data_name, scan
from .folder import Folder, UnsafeFolder
from .job import Job
from .resume import Restored, keep_only, restore
from .secret import job_key
from .snapshots import Writer

FIX = "set BUCKETDDP_SNAPSHOT_DIR to a folder of your own"


class SnapshotFolderError(RuntimeError):
    """The snapshot folder cannot be made or written, or has no room for two snapshots."""


def check_every(every: object) -> int:
    """``every`` as a positive number of steps, or a ValueError naming it."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"snapshot_every must be a positive number of steps, got {every!r}")
    return every


class Session:
    """Snapshots and resume for this process (needs torchrun; see ``Job.from_env``)."""

    def __init__(
        self, every: int = 1, group: dist.ProcessGroup | None = None, signals: str | None = None
    ) -> None:
        self.every = check_every(every)
        self.signals = stop_signals(signals)
        self.job = Job.from_env()
        self.group = group
        self._writer: Writer | None = None
        self._folder: Folder | None = None
        self._key: bytes | None = None
        self._older_attempts_left = self.job.attempt > 0
        self._last_attempt = LastAttempt(self.job, self._end_for_good)

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
            self._last_attempt.arm()
        return self._folder

    def _open(self) -> tuple[Folder, bytes]:
        """The checked folder and the job's key."""
        folder = self._open_folder()
        if self._key is None:
            self._key = job_key(self.job, folder)
        return folder, self._key

    def due(self, step: int) -> bool:
        """Whether a snapshot is due after ``step`` steps (always when the ranks stop)."""
        return step % self.every == 0 or NOTICE.agreed

    def listen(self) -> None:
        """Take over the stop signals (``notice.py``) while training."""
        NOTICE.install(self.signals)

    def stop(self, step: int) -> NoReturn:
        """The ranks agreed to stop after ``step``, whose snapshot this rank took: wait until
        it is written, then until every rank's is (a barrier, once), and raise
        ``Preempted``."""
        if self._writer is not None:
            self._writer.wait()
        self._last_attempt.disarm()  # a job started again with this run id resumes here
        dist.barrier(group=self.group)
        if NOTICE.pending or self.job.rank == 0:
            got = f"got signal {NOTICE.signum}; " if NOTICE.pending else ""
            print(
                f"bucketddp: rank {self.job.rank} {got}every rank stops after step {step}, "
                "whose snapshot the restart resumes from",
                file=sys.stderr,
                flush=True,
            )
        raise Preempted(NOTICE.exit_code())

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

    def check_folders(self, need: int = 0) -> None:
        """Check this node's snapshot folder: private (``folder.py``), writable, with room
        for two snapshots of ``need`` bytes (``room.py``); and agree: if any rank's fails,
        every rank raises (``UnsafeFolder``, else ``SnapshotFolderError``) naming it, before
        training. A collective."""
        problem, unsafe = None, False
        try:
            problem = room.problem(self._open_folder(), need)
        except UnsafeFolder as e:
            problem, unsafe = str(e), True
        except OSError as e:  # the folder cannot be made
            problem = (
                f"cannot make the snapshot folder {self.job.directory()} ({e}): set "
                "BUCKETDDP_SNAPSHOT_DIR to a folder this user can write (default /dev/shm)"
            )
        if problem is not None:
            problem = f"rank {self.job.rank} (node {self.job.node}): {problem}"
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, (problem, unsafe), group=self.group)
        found = [p for p, _ in everyone if p is not None]
        if found:
            kind = UnsafeFolder if any(u for _, u in everyone) else SnapshotFolderError
            raise kind("bucketddp: elastic training cannot start:\n" + "\n".join(found))

    def restore(self, need: int = 0) -> Restored | None:
        """The newest readable snapshot of this job, agreed on and sent to every rank; None
        when there is none. A collective; first checks every rank's folder, with room for
        two snapshots of ``need`` bytes (``check_folders``)."""
        self.check_folders(need)
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

    def _end_for_good(self) -> int:
        """Wait for this rank's writes, then remove the job's folder on this node (and the
        per-user parent if it is left empty); the number of files removed."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return self._folder.remove_all(parents=1) if self._folder is not None else 0

    def finish(self) -> None:
        """A clean finish: wait for this rank's writes, then remove the job's snapshots on
        this node. A collective."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if dist.is_initialized():
            dist.barrier(group=self.group)
        if self.job.local_rank == 0:
            self._open_folder().remove_all(parents=1)
        self._last_attempt.disarm()
        NOTICE.uninstall()
        if self._folder is not None:
            self._folder.close()
            self._folder = None
