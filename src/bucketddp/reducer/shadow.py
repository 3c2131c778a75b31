"""Uneven inputs: what the reducer does for ``join()``.

Under ``join()`` (see ``join.py``) the ranks still training average over fewer ranks, and
a rank that ran out of batches shadows each of their synced backward passes: it
contributes zeros to every bucket's collective, in plan order, and its own agreement row,
so that every rank issues the same collectives and reads the same sums.
"""

from __future__ import annotations

import torch

from .agreement import check, write_agreement
from .requires_grad import reduce_joined
from .state import ReducerState


def shadow_backward(r: ReducerState) -> None:
    """On a rank that has joined, match one synced backward of the ranks still training.

    It sends zeros through every bucket's collective (through the communication hook if
    one is registered) and its own requires_grad flags, so the others average the
    gradients of the ranks still training. It reads the summed row as they do, so an error
    they raise is raised here too, and it takes part in the bucket rebuild after the first
    synced backward. Its own ``.grad`` is left alone.
    """
    if not r.communicates:
        return
    storages = [torch.zeros_like(b.storage) for b in r.buckets]
    table, agreement = r.row.stand_in(storages[-1][r.buckets[-1].grads.numel() :])
    write_agreement(agreement, r)
    r.launcher.reduce_copies(storages, r.buckets, r.sparse)
    error, _, joined = check(r, *r.row.read(table), False)
    if error is None and joined:
        # Parameters now trainable on every rank (this one unfroze them before joining):
        # match the extra all-reduce of the others, contributing nothing, and adopt them.
        error = reduce_joined(r, joined, contribute=False)
    r.end_synced_step(error, joined)
