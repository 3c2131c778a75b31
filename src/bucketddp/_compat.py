"""Where the supported torch releases differ: one function for each API that changed.

bucketddp runs on torch 2.4 to 2.15 (docs/compatibility.md). Each torch API that is not
the same across those releases, and each private one we rely on, is reached through a
function here with its one fallback, so that the rest of the package reads as if there
were a single torch release, and a new release touches this file only. Lightning's
differences (2.4 to 2.6) are here too, without importing Lightning.

This module imports nothing beyond torch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch


def preserve_version_counters(
    tensors: tuple[torch.Tensor, ...],
) -> contextlib.AbstractContextManager[Any]:
    """A context that restores the tensors' autograd version counters when it exits.

    torch 2.5 and later take the tuple at once; torch 2.4 takes one tensor, so each gets
    its own context there (:func:`_preserve_one_by_one`).
    """
    preserve = torch.autograd.grad_mode._unsafe_preserve_version_counter
    try:
        return preserve(tensors)
    except (AttributeError, AssertionError, TypeError):  # torch 2.4: one tensor only
        return _preserve_one_by_one(tensors)


def _preserve_one_by_one(tensors: tuple[torch.Tensor, ...]) -> contextlib.ExitStack:
    """:func:`preserve_version_counters` where torch takes one tensor at a time."""
    preserve = torch.autograd.grad_mode._unsafe_preserve_version_counter
    stack = contextlib.ExitStack()
    for t in tensors:
        stack.enter_context(preserve(t))
    return stack


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many tensors (and storage handles) share ``storage``: a private count, present
    from torch 2.4 to 2.15."""
    return int(torch._C._storage_Use_Count(storage._cdata))


def weights_only_kwargs(weights_only: bool | None) -> dict[str, Any]:
    """The ``weights_only`` keyword to hand on to Lightning's ``load_checkpoint`` methods.

    Lightning 2.4's (strategies and CheckpointIO) take no such keyword, and never pass one
    to ours; later releases default it to None. So it is handed on only when given.
    """
    return {} if weights_only is None else {"weights_only": weights_only}


@functools.cache
def ddp_deprecates_broadcast_buffers() -> bool:
    """Whether torch DDP warns that ``broadcast_buffers`` is deprecated.

    It does from the release that added its successor ``forward_sync_buffers`` (torch 2.13;
    2.10 has neither). Read from the signature, which says it for any release.
    """
    init = torch.nn.parallel.DistributedDataParallel.__init__
    return "forward_sync_buffers" in inspect.signature(init).parameters
