"""A clean exit: no thread of a process group runs Python once the interpreter shuts down.

Why a process could end by SIGABRT after a normal run ("terminate called without an active
exception"): gloo runs each collective on a worker thread of its group
(``pt_gloo_runloop``). When a collective completes, that thread runs the future's Python
callbacks (bucketddp's step clock, a comm hook's ``then``) and then drops its reference to
the work, whose tensors it may by then hold alone: freeing such a tensor frees its Python
object. Both need the GIL. A worker that asks for the GIL after the interpreter has begun to
shut down is ended by CPython with ``pthread_exit``, inside a C++ destructor, and that is
``std::terminate``. The window is short, between a collective's completion and the
thread's return to its queue, but a busy machine can keep a worker off the CPU for tens of
milliseconds right there while the main thread, its collective done, runs to the end of
the script.

``dist.destroy_process_group()`` does not close it: a group lives on, with its threads, while
anything still references it (a wrapper, a reference cycle, and torch._dynamo, which an
optimizer's first step imports, holds ten references to the default group made before it).

So, at exit, bucketddp

1. collects garbage, so that a group held only in reference cycles is freed while the
   interpreter still runs: its destructor lets its threads finish and joins them;
2. waits until no gloo worker thread is runnable and no thread unknown to ``threading`` runs
   Python, seen on three polls in a row (1 ms apart). A worker that waits on a peer does not
   count: a collective still unfinished at exit is the program's to wait for.

The handler is registered on ``import bucketddp``, so it runs after every ``atexit``
handler registered later: the watchdog's, the strategies' group destruction, Lightning's.
A process with no gloo worker thread pays one directory listing. Reading thread states
needs Linux's ``/proc``; elsewhere step 2 is skipped.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time

from ._compat import gloo_threads_named

HANG_GUARD = 10.0  # seconds: the wait ends here whatever the threads do
POLL = 0.001  # seconds between looks, the GIL released
QUIET_POLLS = 3
WORKER_PREFIX = "pt_gloo"  # torch names gloo's worker threads pt_gloo_runloop

_TASKS = "/proc/self/task"
_installed = False
waiting = False  # True while ``settle`` waits for the threads (a test reads it)


def install() -> None:
    """Register the exit handler once (``import bucketddp`` does)."""
    global _installed
    if not _installed:
        _installed = True
        atexit.register(settle)


def settle(timeout: float = HANG_GUARD) -> bool:
    """Free unreferenced process groups and wait until no worker of one is about to run
    Python; returns whether the threads settled (True when there were none)."""
    if not gloo_workers():
        return True
    gc.collect()
    if not gloo_workers():
        return True  # the groups were freed and their threads joined
    global waiting
    deadline = time.monotonic() + timeout
    quiet = 0
    waiting = True
    try:
        while quiet < QUIET_POLLS:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL)
            quiet = 0 if _busy() else quiet + 1
    finally:
        waiting = False
    return True


def gloo_workers() -> list[int]:
    """Thread ids of this process's gloo worker threads (empty without ``/proc``).

    A torch that leaves them unnamed (``_compat.gloo_threads_named``) gives them the main
    thread's name: there every thread of that name that ``threading`` does not know counts
    (gloo's, and any other C++ thread started from the main thread, such as OpenMP's).
    """
    try:
        tids = [int(t) for t in os.listdir(_TASKS)]
    except OSError:
        return []
    names = {t: _read(f"{_TASKS}/{t}/comm") for t in tids}
    named = [t for t in tids if names[t].startswith(WORKER_PREFIX)]
    if named or gloo_threads_named():
        return named
    main = os.getpid()
    known = {t.native_id for t in _python_threads()}
    return [t for t in tids if t != main and t not in known and names[t] == names.get(main)]


def _python_threads() -> list[threading.Thread]:
    """The threads Python started. A C++ thread that ran a Python callback may have a
    ``_DummyThread``; it is not one of them."""
    return [t for t in threading.enumerate() if type(t).__name__ != "_DummyThread"]


def _busy() -> bool:
    """A gloo worker is on or waiting for the CPU, or a foreign thread runs Python."""
    for tid in gloo_workers():
        stat = _read(f"{_TASKS}/{tid}/stat")
        # The state follows the parenthesized name, which may itself hold ") ".
        if stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] == "R":
            return True
    # A C++ thread running a Python callback has a frame but no threading.Thread.
    known = {t.ident for t in _python_threads()}
    return any(ident not in known for ident in sys._current_frames())


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""
