"""A guard for processes forked beside gloo's threads, on Pythons with CPython's gh-112275.

A thread that enters Python without a thread state of its own makes one under the
interpreter's runtime lock, without the GIL. gloo's worker threads (``pt_gloo_runloop``) do
so several times per collective: they free the Python objects of the tensors a finished
collective held, and run a future's Python callbacks. On Python 3.10 before 3.10.15 and
3.11 before 3.11.10, a child forked while one of them holds that lock inherits it locked,
and waits for it forever in ``PyOS_AfterFork_Child``, before any of its own code runs: a
``DataLoader`` worker that never starts, and its rank waiting on it.

On those Pythons, ``import bucketddp`` registers a function that runs just before each
``os.fork`` (``os.register_at_fork``) and takes that lock once, through
``sys._current_frames()``: a fork that would start while a gloo thread holds it waits for
the thread instead. It narrows the race rather than closing it (a thread may take the lock
between that call and the fork); measured, ``python3 dev.py fork-repro``
(2 gloo ranks forking beside a stream of collectives, three runs each way, interleaved)
hung 16 of 18,000 children without it and none of 18,000 with it, Python 3.11.7. It costs
one look at the threads per fork. Newer Pythons reset the lock in the child, and get no
guard. docs/reliability.md, "A fork that never starts", says more.
"""

from __future__ import annotations

import os
import sys

_installed = False


def affected(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether this CPython has gh-112275 (fixed in 3.10.15, 3.11.10 and 3.12)."""
    fixed_in = {10: (3, 10, 15), 11: (3, 11, 10)}.get(version[1]) if version[0] == 3 else None
    return fixed_in is not None and tuple(version) < fixed_in


def _before_fork() -> None:
    # Takes the runtime lock that a thread making its thread state holds, and frees it.
    sys._current_frames()


def install() -> bool:
    """Register the guard once, on an affected CPython (``import bucketddp`` does);
    returns whether it is registered."""
    global _installed
    if not _installed and affected() and sys.implementation.name == "cpython":
        os.register_at_fork(before=_before_fork)
        _installed = True
    return _installed
