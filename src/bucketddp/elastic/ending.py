"""When a job ends for good, the node's snapshots go: on its last attempt, or a clean exit.

Snapshots exist for torchrun's next restart. torchrun tells each worker which attempt it
is (``TORCHELASTIC_RESTART_COUNT``) and how many restarts its agent allows
(``TORCHELASTIC_MAX_RESTARTS``). On the last attempt, a worker that fails makes its agent
stop the node's other workers and exit: no restart on this node will read its snapshots,
and they hold shared memory (``/dev/shm``) the next job needs.

So on the last attempt, once a session has opened the node's folder, ``LastAttempt`` is
armed: when the process exits, by an exception (a collective that failed because a peer
died, the watchdog's ``RankFailedError``), by ``sys.exit``, or through the watchdog's
forced exit of a main thread stuck in C++, it waits for this rank's writes and removes the
node's job folder, and the per-user parent if that is left empty. Every rank of the node
does so on its way out, so the last to leave leaves nothing, whichever ranks died first.
How the others end when one is SIGKILLed: torchrun's agent sends them SIGTERM, which the
stop-signal handler (``notice.py``) only notes, and their next collective fails (or the
watchdog names the dead peer and raises): they exit through Python, and ``atexit`` runs.

A stop on a notice (``Session.stop``) disarms it, keeping the snapshots: a preempted job may
be started again with the same run id, and resumes from them. A process killed outright
(SIGKILL, a lost node) removes nothing; ``python -m bucketddp.snapshots`` lists and removes
what is left.

Before the last attempt, a finished fit keeps its final snapshot (``Session.finish``): a
rank that dies after ``fit()`` returned makes torchrun restart every worker, and the
restart returns at once with that state. ``CleanExit`` removes it when the job is over on
this node: torchrun's agent restarts nothing once every worker of the node has exited with
0, so each worker that exits cleanly (through ``atexit``, with no uncaught exception)
leaves a mark, and the one that finds every local rank's mark of this attempt removes the
node's folder. A worker killed, or ended by an error, leaves no mark.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable

from ..faults import last_words
from .folder import Folder
from .job import Job


class LastAttempt:
    """On the job's last attempt, ``remove()`` at this process's exit unless disarmed."""

    def __init__(self, job: Job, remove: Callable[[], int]) -> None:
        self.job = job
        self._remove = remove
        self._armed = False
        self._lock = threading.Lock()

    def arm(self) -> None:
        """From now on, the exit removes the node's snapshots (a no-op before the last
        attempt: a restart reads them)."""
        if not self.job.last_attempt:
            return
        with self._lock:
            if self._armed:
                return
            self._armed = True
        atexit.register(self.at_exit)
        last_words.before_forced_exit(self.at_exit)

    def disarm(self) -> None:
        """The snapshots are kept, or already removed: the exit leaves them."""
        with self._lock:
            self._armed = False
        atexit.unregister(self.at_exit)
        last_words.before_forced_exit(self.at_exit, add=False)

    def at_exit(self) -> None:
        """This process ends on the last attempt: remove the node's snapshots (once)."""
        with self._lock:
            armed, self._armed = self._armed, False
        if not armed:
            return
        why = (
            f"attempt {self.job.attempt} was the last torchrun allows (--max-restarts="
            f"{self.job.max_restarts}), so no restart will read them"
        )
        remove_and_say(self.job, self._remove, why)


def remove_and_say(job: Job, remove: Callable[[], int], why: str) -> None:
    """Call ``remove``; say on stderr that this node's snapshots went (``why``), or why they
    could not (the exit goes on either way)."""
    try:
        removed = remove()
    except Exception as e:  # the command can remove them
        print(
            f"bucketddp: rank {job.rank} could not remove this node's snapshots: "
            f"{e!r} (python -m bucketddp.snapshots list)",
            file=sys.stderr,
            flush=True,
        )
        return
    if removed:
        print(
            f"bucketddp: rank {job.rank} removed this node's snapshots: {why}",
            file=sys.stderr,
            flush=True,
        )


def exit_mark(job: Job, local_rank: int) -> str:
    """The name of the file local rank ``local_rank`` leaves at a clean exit (``CleanExit``)."""
    return f"exited.a{job.attempt}.n{job.node}.l{local_rank}"


class CleanExit:
    """Once training is over: at a clean exit, leave this rank's mark; the node's last to
    do so calls ``remove()`` (see the module docstring)."""

    def __init__(self, job: Job, folder: Callable[[], Folder | None], remove: Callable[[], int]):
        self.job = job
        self._folder = folder
        self._remove = remove
        self._armed = False

    def arm(self) -> None:
        """From now on (training is over), a clean exit counts."""
        if not self._armed:
            self._armed = True
            atexit.register(self.at_exit)

    def at_exit(self) -> None:
        """This process ends: if cleanly, mark it, and remove the node's snapshots if every
        local rank of this attempt has."""
        armed, self._armed = self._armed, False
        folder = self._folder()
        if not armed or folder is None or getattr(sys, "last_value", None) is not None:
            return  # an uncaught exception: torchrun's agent may restart this node

        def mark_and_remove() -> int:
            try:
                folder.write(exit_mark(self.job, self.job.local_rank), b"")
            except FileNotFoundError:
                return 0  # the folder is gone: a rank of the last attempt removed it
            names = set(folder.names())
            if any(exit_mark(self.job, r) not in names for r in range(self.job.local_world_size)):
                return 0
            return self._remove()

        remove_and_say(
            self.job, mark_and_remove, "every worker of the node exited cleanly after training"
        )
