"""Checking the snapshot folder before the first step: it can be written, and has room.

A folder that cannot be made or written, or a ``/dev/shm`` smaller than two snapshots
(Docker's default is 64 MB), would otherwise fail at the first snapshot, after training
started, and again on every restart. ``Session.check_folders`` asks every rank here
before training and raises on every rank, naming the variable, the sizes and the fix.

The size is an estimate made before training: the tensors of the state as it is then,
and for an optimizer that holds no state yet (most make it at their first step), two
tensors the size of each parameter it updates (Adam's moments; an upper bound for SGD).
A node's ranks share one copy of each snapshot, and a node keeps two.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from typing import Any

import torch

from .folder import Folder

PROBE = "probe"
FIX_ROOM = (
    "give the folder more room (docker run --shm-size=..., a larger /dev/shm or tmpfs), "
    "or set BUCKETDDP_SNAPSHOT_DIR to a folder with room (a local disk is slower to write)"
)


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def estimate(values: Iterable[Any]) -> int:
    """The bytes of one snapshot of ``values`` (models, optimizers, ...; see the module
    docstring for an optimizer with no state yet)."""
    total = 0
    for value in values:
        if isinstance(value, torch.optim.Optimizer) and not value.state:
            params = [p for g in value.param_groups for p in g["params"]]
            total += 2 * _tensor_bytes(params)
        if hasattr(value, "state_dict"):
            total += _tensor_bytes(value.state_dict())
        else:
            total += _tensor_bytes(value)
    return total


def size_text(n: float) -> str:
    """``n`` bytes in words: ``"120.0 MiB"``."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def unwritable(folder: Folder) -> OSError | None:
    """Why nothing can be written in ``folder``, or None (a probe file is made and removed)."""
    try:
        folder.write(PROBE, b"")
        folder.remove(PROBE)
    except OSError as e:
        return e
    return None


def free(folder: Folder) -> int:
    """The bytes ``folder``'s file system has free, counting this job's files there."""
    st = os.statvfs(folder.path)
    return st.f_bavail * st.f_frsize + folder.bytes_held()


def problem(folder: Folder, need: int) -> str | None:
    """Why ``folder`` cannot hold two snapshots of ``need`` bytes each, or None: it cannot
    be written, or its file system has less room free (counting this job's files there)."""
    if (e := unwritable(folder)) is not None:
        return (
            f"cannot write in the snapshot folder {folder.path} ({e}): set "
            "BUCKETDDP_SNAPSHOT_DIR to a folder this user can write (default /dev/shm)"
        )
    room = free(folder)
    if need > 0 and room < 2 * need:
        return (
            f"the snapshot folder {folder.path} (BUCKETDDP_SNAPSHOT_DIR, default /dev/shm) has "
            f"{size_text(room)} free, and two snapshots of this state need about "
            f"{size_text(2 * need)} on each node: {FIX_ROOM}"
        )
    return None


def no_room(path: object, nbytes: int, e: OSError) -> OSError:
    """The error for a snapshot file that cannot get its ``nbytes`` (``e``: ENOSPC)."""
    return OSError(
        errno.ENOSPC,
        f"bucketddp: no room for a snapshot file of {size_text(nbytes)} in {path} ({e}): "
        f"{FIX_ROOM}",
    )
