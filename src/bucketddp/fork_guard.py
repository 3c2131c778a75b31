"""A guard for processes forked beside gloo's threads, on Pythons with CPython's gh-112275.

A thread that enters Python without a thread state of its own makes one under the
interpreter's runtime lock, without the GIL. gloo's worker threads (``pt_gloo_runloop``) do
so several times per collective: they free the Python objects of the tensors a finished
collective held, and run a future's Python callbacks. On Python 3.10 before 3.10.15 and
3.11 before 3.11.10, a child forked while one of them holds that lock inherits it locked,
and waits for it forever in ``PyOS_AfterFork_Child``, before any of its own code runs: a
``DataLoader`` worker that never starts, and its rank waiting on it.

On those Pythons, ``import bucketddp`` registers a function that runs just before each
``os.fork`` (``os.register_at_fork``) and takes that lock once: a fork that would start
while a gloo thread holds it waits for the thread instead. It narrows the race rather than
closing it (a thread may take the lock between that call and the fork). Measured with
``python3 dev.py fork-repro`` (2 gloo ranks forking beside a stream of collectives, three
runs each way, interleaved, Python 3.11.7): 15 of 18,000 children hung without it, none of
18,000 with it. It costs about half a microsecond per fork. Newer Pythons reset the lock in
the child, and get no guard. docs/reliability.md, "A fork that never starts", says more.

The lock is taken through ``PyThreadState_SetAsyncExc`` for a thread id no thread has,
which holds it only to walk the list of thread states: nothing is allocated and no Python
code runs under it. (``sys._current_frames()`` also takes it, but allocates under it; a
garbage collection started there could run a finalizer that hands the GIL to a thread
that then waits for the lock.)
"""

from __future__ import annotations

import ctypes
import os
import sys

_installed = False
_NO_THREAD = 0  # no thread state has id 0: a pthread_t is never 0


def affected(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether this CPython has gh-112275 (fixed in 3.10.15, 3.11.10 and 3.12)."""
    fixed_in = {10: (3, 10, 15), 11: (3, 11, 10)}.get(version[1]) if version[0] == 3 else None
    return fixed_in is not None and tuple(version) < fixed_in


def _walk_thread_states() -> int:
    """Take and free the runtime lock, with the GIL held (``pythonapi`` keeps it)."""
    return int(ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(_NO_THREAD), None))


def _before_fork() -> None:
    # Waits for a thread that is making its thread state under the lock.
    _walk_thread_states()


def install() -> bool:
    """Register the guard once, on an affected CPython (``import bucketddp`` does);
    returns whether it is registered."""
    global _installed
    if _installed or not affected() or sys.implementation.name != "cpython":
        return _installed
    try:
        _walk_thread_states()  # a build that does not export the C API gets no guard
    except (AttributeError, OSError):
        return False
    os.register_at_fork(before=_before_fork)
    _installed = True
    return True
