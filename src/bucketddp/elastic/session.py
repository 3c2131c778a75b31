"""One process's part in elastic training: snapshots out at step boundaries, resume in.

The Trainer and Fabric strategies and the plain-loop helper each hold one ``Session``. It
knows the job (``job.py``), opens and checks the node's private snapshot folder
(``folder.py``) and gets the job's key (``secret.py``), writes this rank's share of every
``every``-th snapshot (``snapshots.py``), restores the newest one after a restart
(``resume.py``), and keeps at most two snapshots per node. A finished fit keeps its final
state, marked finished, so that a restart after it does no training step; the node's
snapshots go when the job ends for good there: when its workers have all exited cleanly
after training, and at any exit of its last attempt (``ending.py``).

Each fit of the script (each ``restore``, else the first ``take``) is numbered, per
attempt: a restart resumes a fit only from that fit's snapshots.

With a disk folder (``disk.py``), a stop on a notice also copies its snapshot there, and
removes the node's ``/dev/shm`` copies; ``requeue``, if set, is then called on rank 0 (a
SLURM requeue: ``slurm.py``). Under SLURM without torchrun, nothing restarts the workers
in place, so only a stop takes a snapshot.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

from ..notice import NOTICE, Preempted, stop_signals
from . import room, slurm
from .disk import Disk, preempt_dir
from .ending import CleanExit, LastAttempt
from .files import data_name, scan
from .folder import Folder, UnsafeFolder
from .job import Job, under_slurm, under_torchrun
from .resume import Restored, keep_only, restore
from .secret import job_key
from .snapshots import Writer

FIX = "set BUCKETDDP_SNAPSHOT_DIR to a folder of your own"
DISK_FIX = "give preempt_dir (BUCKETDDP_PREEMPT_DIR) a folder of your own with room"
_phases: dict[tuple[str, int], int] = {}  # (run id, attempt) -> fits numbered so far


class SnapshotFolderError(RuntimeError):
    """The snapshot folder cannot be made or written, or has no room for two snapshots."""


def check_every(every: object) -> int:
    """``every`` as a positive number of steps, or a ValueError naming it."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"snapshot_every must be a positive number of steps, got {every!r}")
    return every


def open_session(
    every: int = 1,
    group: dist.ProcessGroup | None = None,
    signals: str | None = None,
    disk: str | os.PathLike[str] | None = None,
    *,
    requeue: bool = False,
) -> Session | None:
    """This process's ``Session``: under torchrun, or under SLURM's srun with a disk folder
    (``disk``, else ``BUCKETDDP_PREEMPT_DIR``), where ``requeue`` makes rank 0 requeue the
    job after a stop (``slurm.py``). None anywhere else (nothing would resume)."""
    folder = preempt_dir(disk)
    if not (under_torchrun() or (under_slurm() and folder is not None)):
        check_every(every)
        return None
    session = Session(every, group, signals, folder)
    if requeue and session.job.slurm:
        session.requeue = slurm.requeue
    return session


class Session:
    """Snapshots and resume for this process (needs torchrun; see ``Job.from_env``)."""

    def __init__(
        self,
        every: int = 1,
        group: dist.ProcessGroup | None = None,
        signals: str | None = None,
        disk: Path | None = None,
    ) -> None:
        self.every = check_every(every)
        self.signals = stop_signals(signals)
        self.job = Job.from_env()
        self.group = group
        self.disk = Disk(disk) if disk is not None else None
        self.requeue: Callable[[], None] | None = None  # called on rank 0 after a stop
        self._writer: Writer | None = None
        self._folder: Folder | None = None
        self._key: bytes | None = None
        self._older_attempts_left = self.job.attempt > 0
        self._last_attempt = LastAttempt(self.job, self._end_for_good)
        self._clean_exit = CleanExit(self.job, lambda: self._folder, self._end_for_good)
        self.phase = 0  # this fit's number in the script (``_new_phase``)
        self.finished = False  # training is over: the node's snapshots hold its end

    def _new_phase(self) -> int:
        """Number a new fit: the next of this run and attempt (1 for the first)."""
        which = (self.job.run_id, self.job.attempt)
        _phases[which] = self.phase = _phases.get(which, 0) + 1
        self.finished = False
        return self.phase

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
            other = self.disk.kept_key if self.disk is not None else None
            self._key = job_key(self.job, folder, other)
        return folder, self._key

    def due(self, step: int) -> bool:
        """Whether a snapshot is due after ``step`` steps (always when the ranks stop; only
        then under SLURM, where no restart in place reads one)."""
        return NOTICE.agreed or (not self.job.slurm and step % self.every == 0)

    def listen(self) -> None:
        """Take over the stop signals (``notice.py``) while training."""
        NOTICE.install(self.signals)

    def stop(self, step: int) -> NoReturn:
        """The ranks agreed to stop after ``step``, whose snapshot this rank took: wait until
        it is written, copy it to the disk folder if there is one (``to_disk``), wait until
        every rank has (a collective, once), call ``requeue`` on rank 0 if set, and raise
        ``Preempted``."""
        if self._writer is not None:
            self._writer.wait()
        where = "the restart resumes from"
        if self.disk is not None:
            if self.to_disk(step):
                where = f"is in {self.disk.path}, where the job resumes from"
        else:
            if not self.job.slurm:  # a job started again with this run id resumes here
                self._last_attempt.disarm()
            dist.barrier(group=self.group)
        if NOTICE.pending or self.job.rank == 0:
            got = f"got signal {NOTICE.signum}; " if NOTICE.pending else ""
            print(
                f"bucketddp: rank {self.job.rank} {got}every rank stops after step {step}, "
                f"whose snapshot {where}",
                file=sys.stderr,
                flush=True,
            )
        if self.requeue is not None and self.job.rank == 0:
            self.requeue()
        raise Preempted(NOTICE.exit_code())

    def to_disk(self, step: int) -> bool:
        """Copy this rank's share of the snapshot of ``step`` to the disk folder, and agree
        (a collective) whether every rank's copy is written. If so, keep only it there and
        remove this node's ``/dev/shm`` snapshots; if not, keep those, and say why."""
        assert self.disk is not None
        problem = None
        try:
            committed = self._writer.committed if self._writer is not None else None
            if committed is None or committed[0] != step:
                raise RuntimeError(f"no snapshot of step {step} in {self.job.directory()}")
            folder, key = self._open()
            self.disk.save(self.job, folder, committed[1], key)
        except Exception as e:  # the /dev/shm snapshot stays
            problem = f"rank {self.job.rank}: {e!r}"
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, problem, group=self.group)
        found = [p for p in everyone if p is not None]
        if found:
            if not self.job.slurm:
                self._last_attempt.disarm()
            if self.job.rank == 0:
                print(
                    f"bucketddp: the snapshot of step {step} could not be copied to "
                    f"{self.disk.path} (preempt_dir): " + "; ".join(found),
                    file=sys.stderr,
                    flush=True,
                )
            return False
        if self.job.rank == 0:
            self.disk.keep_only((self.phase, step, False, self.job.attempt), self._open()[1])
        self._last_attempt.disarm()
        if self.job.local_rank == 0:
            self._end_for_good()
        return True

    def take(
        self,
        step: int,
        state: Any,
        own: Any = None,
        *,
        finished: bool = False,
        late: Collection[int] = (),
    ) -> None:
        """Write this rank's share of the snapshot of ``step`` (the write finishes in the
        background); ``own`` is this rank's own part (RNG states, its own buffers);
        ``finished`` marks the state at the fit's end (``finish``); ``late``: the tensors
        (by ``data_ptr()``) whose copy may wait until ``settle`` (``snapshots.Writer``)."""
        if self._writer is None:
            self._writer = Writer(self.job, *self._open())
        self.finished = False
        phase = self.phase or self._new_phase()
        self._writer.take(step, state, own, phase=phase, finished=finished, late=late)
        if self._older_attempts_left and self.job.local_rank == 0:
            self._drop_older_attempts()

    def settle(self) -> None:
        """Wait until the last snapshot's copy is done: call before an optimizer step."""
        if self._writer is not None:
            self._writer.settle()

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
        if problem is None and self.disk is not None:
            problem, unsafe = self._disk_problem(need)
        if problem is not None:
            problem = f"rank {self.job.rank} (node {self.job.node}): {problem}"
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, (problem, unsafe), group=self.group)
        found = [p for p, _ in everyone if p is not None]
        if found:
            kind = UnsafeFolder if any(u for _, u in everyone) else SnapshotFolderError
            raise kind("bucketddp: elastic training cannot start:\n" + "\n".join(found))

    def _disk_problem(self, need: int) -> tuple[str | None, bool]:
        """Why the disk folder cannot take a stop's snapshot of ``need`` bytes, or None;
        and whether it is unsafe."""
        assert self.disk is not None
        try:
            folder = self.disk.open()
        except UnsafeFolder as e:
            return str(e), True
        except OSError as e:
            return f"cannot make the disk folder {self.disk.path} ({e}): {DISK_FIX}", False
        if (why := room.unwritable(folder)) is not None:
            return f"cannot write in the disk folder {self.disk.path} ({why}): {DISK_FIX}", False
        free = room.free(folder)
        if self.job.node == 0 and free < need:
            return (
                f"the disk folder {self.disk.path} has {room.size_text(free)} free, and a "
                f"stop's snapshot needs about {room.size_text(need)}: {DISK_FIX}",
                False,
            )
        return None, False

    def restore(self, need: int = 0) -> Restored | None:
        """The newest readable snapshot of this job, agreed on and sent to every rank; None
        when there is none. A collective; first checks every rank's folder, with room for
        two snapshots of ``need`` bytes (``check_folders``)."""
        self.check_folders(need)
        folder, key = self._open()
        restored = restore(self.job, folder, key, self.group, self._new_phase(), self.disk)
        if restored is not None:
            step, finished = restored.step, restored.finished
            keep_only(self.job, folder, key, step, finished, self.phase, restored.scanned)
            if restored.finished:  # no training step is left: only the exit
                self.finished = True
                self._clean_exit.arm()
                NOTICE.uninstall()
        return restored

    def _close_writer(self) -> None:
        """Wait for this rank's writes, and stop its writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _end_for_good(self) -> int:
        """Wait for this rank's writes, then remove the job's folder on this node (and the
        per-user parent if it is left empty); the number of files removed."""
        self._close_writer()
        return self._folder.remove_all(parents=1) if self._folder is not None else 0

    def finish(self, step: int | None = None, state: Any = None, own: Any = None) -> None:
        """Training is over. With ``state``: take the snapshot of the fit's end (``step``,
        ``own`` as for ``take``), marked finished, wait until every rank's is written (a
        barrier), and keep only it on this node. Without: keep the newest snapshot as it
        is. Either way, the node's snapshots are removed when its workers have all exited
        cleanly (``ending.CleanExit``), or at any exit of the last attempt; a restart before
        then resumes from them and does no training step."""
        if state is not None:
            assert step is not None
            self.take(step, state, own, finished=True)
            self._close_writer()
            if dist.is_initialized():
                dist.barrier(group=self.group)
            folder, key = self._open()
            keep_only(self.job, folder, key, step, True, self.phase)
            self.finished = True
        self._close_writer()
        if self.disk is not None and self.job.rank == 0:
            self.disk.clear()  # the job is done: a stop's copy would resume it again
        self._clean_exit.arm()
        NOTICE.uninstall()
