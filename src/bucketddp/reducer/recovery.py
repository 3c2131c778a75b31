"""A backward pass that raised midway: noticed at the next forward, and discarded.

Its end-of-backward callback never ran, so buckets may be half staged and collectives in
flight. The next forward through the wrapper finds the step unfinished and discards it,
after waiting for what it launched.
"""

from __future__ import annotations

import logging

import torch

from .state import ReducerState

log = logging.getLogger("bucketddp.reducer")


def step_unfinished(r: ReducerState) -> bool:
    """Whether a backward pass of ``r`` started but never reached its end.

    Not while that backward is still running: a forward inside it (the recomputation of
    ``checkpoint(model, x)``) belongs to it.
    """
    return r.in_backward and torch._C._current_graph_task_id() == -1


def discard_step(r: ReducerState) -> None:
    """Forget the unfinished backward pass of ``r``, so the next one starts clean.

    Collectives it already launched are waited for first, so that they cannot write into
    bucket storage the next step is filling. Every rank that launched them is matched by
    the others: ranks that failed at the same point launched the same ones, and ranks that
    finished their backward launched all of them.
    """
    log.warning(
        "bucketddp: the previous backward pass did not finish (it raised); its partial "
        "gradient reduction is discarded"
    )
    if r.sparse is not None:
        r.sparse.wait()
    for bucket in r.buckets:
        bucket.wait()
    r.reset_step(synced=True)
