"""What runs before the watchdog ends this process with ``os._exit`` (which skips ``atexit``).

A capability that must act at any exit (removing the node's snapshots on a job's last
attempt) registers here as well as with ``atexit``; the watchdog's forced exit of a main
thread stuck in C++ runs each callback, from its own thread, and then exits.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

_CALLBACKS: list[Callable[[], object]] = []


def before_forced_exit(callback: Callable[[], object], *, add: bool = True) -> None:
    """Run ``callback()`` before the watchdog's forced exit; ``add=False`` takes it back."""
    if add and callback not in _CALLBACKS:
        _CALLBACKS.append(callback)
    elif not add and callback in _CALLBACKS:
        _CALLBACKS.remove(callback)


def run() -> None:
    """Run every callback; one that raises is reported and the others still run."""
    for callback in list(_CALLBACKS):
        try:
            callback()
        except Exception as e:  # the exit goes on
            print(f"bucketddp: before the exit: {e!r}", file=sys.stderr, flush=True)
