"""A stop's snapshot on disk, for a preemption that takes the whole job.

A snapshot in ``/dev/shm`` serves a restart on the same nodes. A whole-job preemption (a
SLURM requeue, every torchrun agent signalled) may start the job again on other nodes,
where ``/dev/shm`` is empty. With a disk folder given (``preempt_dir=``, else
``BUCKETDDP_PREEMPT_DIR``), a stop on a notice (``notice.py``) also copies the snapshot of
the stop step there, once every rank's share of it is written:

- every rank copies its meta (which holds its own part: RNG states, own buffers, the comm
  hook's per-rank state); the ranks of node 0 also copy their data files, the shared
  state's bytes, so the state is on disk once whatever the number of nodes;
- each file is written whole (a new file, ``fsync``, a rename), the data before the meta
  that makes it count, so a copy cut short is never loaded;
- the job's key goes with them (file ``key``, mode ``0600``), so a job started again, with
  a new store, checks and reads the metas.

The folder is private, as the snapshot folder is (``folder.py``): its last level is made
``0700`` and must be this user's alone. After the copy, rank 0 keeps only this stop's
files there, and the node's ``/dev/shm`` snapshots are removed: the job's state is on
disk. A job started again resumes from whichever is newer, ``/dev/shm`` or the disk; a fit
that finishes removes the disk copy.

The disk copy is written in the grace period between the notice and the kill: the time to
write the state once, from node 0's ranks in parallel.
"""

from __future__ import annotations

import os
from pathlib import Path

from .files import Snapshot, data_name, remove_except, scan
from .folder import Folder, UnsafeFolder
from .job import Job

ENV = "BUCKETDDP_PREEMPT_DIR"


def preempt_dir(given: str | os.PathLike[str] | None) -> Path | None:
    """The disk folder for a stop's snapshot: ``given``, else ``BUCKETDDP_PREEMPT_DIR``,
    else None (none)."""
    if given is None:
        given = os.environ.get(ENV) or None
    return None if given is None else Path(given).absolute()


class Disk:
    """The disk folder of a stop's snapshot (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._folder: Folder | None = None

    def open(self) -> Folder:
        """The checked folder (made if missing); raises ``UnsafeFolder`` naming the option,
        or ``OSError``."""
        if self._folder is None:
            try:
                self._folder = Folder.open(self.path, private=1)
            except UnsafeFolder as e:
                raise UnsafeFolder(f"{e} (preempt_dir, {ENV})") from None
        return self._folder

    def save(self, job: Job, shm: Folder, meta: str, key: bytes) -> None:
        """Copy this rank's committed meta ``meta`` (and, on node 0, its data) from ``shm``,
        each file whole and synced; rank 0 also writes the job's key."""
        folder = self.open()
        folder.remove(meta)  # a meta left from an earlier stop must not describe new data
        if job.node == 0:
            folder.copy_in(shm, data_name(meta))
        folder.copy_in(shm, meta)
        if job.rank == 0:
            folder.write("key", key.hex().encode("ascii"), sync=True)

    def keep_only(self, which: tuple[int, int, bool, int], key: bytes) -> None:
        """Remove every snapshot file but those of the stop ``which`` (phase, step,
        finished, attempt): once every rank's copy is written."""
        folder = self.open()
        keep = [
            m["name"]
            for s in scan(folder, key)
            if (s.phase, s.step, s.finished, s.attempt) == which
            for m in s.metas.values()
        ]
        remove_except(folder, keep)

    def kept_key(self) -> str:
        """The key a stop wrote here, or ""."""
        try:
            return self.open().read("key").decode("ascii")
        except (OSError, UnicodeDecodeError):
            return ""

    def snapshots(self, key: bytes) -> tuple[list[Snapshot], list[Snapshot]]:
        """The folder's snapshots that ``key`` checks: those with their data (node 0's,
        which can be loaded), and all of them (whose metas hold the ranks' own parts)."""
        folder = self.open()
        names = set(folder.names())
        found = scan(folder, key)
        whole = [s for s in found if all(data_name(m["name"]) in names for m in s.metas.values())]
        return whole, found

    def clear(self) -> None:
        """Remove the snapshot files and the key (the folder stays)."""
        folder = self.open()
        remove_except(folder, [])
        folder.remove("key")
