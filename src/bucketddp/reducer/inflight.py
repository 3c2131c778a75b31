"""What a reducer is doing right now, in words, for the watchdog's stall report.

Read from the watchdog's thread while the main thread may be inside the backward, so it
only reads plain attributes and tolerates a state that changes under it.
"""

from __future__ import annotations

from typing import Any

from .state import ReducerState

_NAMES = 3  # parameter names shown per bucket


def _done(work: Any) -> bool:
    """Whether a bucket's collective (a ``Work`` or a hook's ``Future``) completed."""
    done = getattr(work, "is_completed", None) or getattr(work, "done", None)
    return bool(done()) if done is not None else False


def describe(r: ReducerState) -> tuple[bool, str]:
    """(whether a collective of ``r`` is in flight, what its backward is doing) or (False, "")."""
    buckets = list(r.buckets)
    in_flight = [k for k, b in enumerate(buckets) if b.work is not None and not _done(b.work)]
    if in_flight:
        k = in_flight[0]
        names = [r.names[i] for i in buckets[k].members[:_NAMES]]
        more = len(buckets[k].members) - len(names)
        return True, (
            f"backward, waiting for the all-reduce of bucket {k} of {len(buckets)} "
            f"({', '.join(names)}{f' and {more} more' if more > 0 else ''})"
        )
    if not r.in_backward:
        return False, ""
    ready = list(r.ready)
    deferred = r.deferred
    for k, bucket in enumerate(buckets):
        if deferred is not None and bucket is deferred.bucket:
            # Staged at the end of the backward (deferred.py): its members are not counted
            # as they come.
            return False, f"backward, before bucket {k} of {len(buckets)} (staged at its end)"
        if bucket.pending > 0:
            missing = [r.names[i] for i in bucket.members if i < len(ready) and not ready[i]]
            shown = ", ".join(missing[:_NAMES])
            more = len(missing) - _NAMES
            return False, (
                f"backward, bucket {k} of {len(buckets)} waits for the gradients of "
                f"{shown}{f' and {more} more' if more > 0 else ''}"
            )
    return False, "backward"
