"""What differs between the torch and Lightning releases bucketddp supports, each behind one
function.

bucketddp runs on torch 2.5 to 2.15 and Lightning 2.4 to 2.6 (docs/compatibility.md).
Every torch or Lightning API that some supported release lacks, or spells differently, and
each private torch API we rely on, is reached through this module, with one fallback each,
so that a version bump touches one file and no version checks are scattered through the
package. It imports nothing beyond torch (not Lightning).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .versions import warn_if_untested

OLDEST_TORCH = "2.5"
"""torch 2.4's autograd engine does not run a hook registered on the node that is running.
The reducer registers one to finish a step whose first gradients come from a reentrant
checkpoint's nested backward (``Reducer.finalize_backward``); on 2.4 such a step never
finished, and its gradients stayed local."""


def check_torch() -> None:
    """Refuse a torch older than :data:`OLDEST_TORCH` at ``import bucketddp``.

    Raises:
        ImportError: naming the release found and the one needed.
    """
    if torch.__version__ < OLDEST_TORCH:
        raise ImportError(
            f"bucketddp needs torch {OLDEST_TORCH} or newer; this is torch {torch.__version__}, "
            "whose autograd engine skips a hook bucketddp needs at the end of a reentrant "
            f"checkpoint's backward. Upgrade: pip install 'torch>={OLDEST_TORCH}'"
        )


def base_store(store: dist.Store) -> dist.Store:
    """The store under any ``PrefixStore`` wrappers of ``store``."""
    while isinstance(store, dist.PrefixStore):
        inner = getattr(store, "underlying_store", None)
        if inner is None:  # a release without the attribute: stop at the prefix store
            return store
        store = inner
    return store


def connection_keys(store: dist.Store) -> dist.Store:
    """``store`` with the keys a ``store_connection`` to it sees, over its open connection:
    a ``TCPStore`` under its prefixes, any other store as it is."""
    base = base_store(store)
    return base if isinstance(base, dist.TCPStore) else store


def store_connection(store: dist.Store, timeout: timedelta) -> dist.Store:
    """A new client connection to the server behind ``store``, for another thread's calls.

    A ``TCPStore`` (under any prefixes) gets a new ``TCPStore`` client to the same host and
    port, which gives up connecting after ``timeout`` (``Store.clone()`` would wait the
    process group's whole timeout, and exists only on newer releases). Keys are not
    prefixed as ``store``'s are: the caller picks its own. Any other store is cloned where
    this torch can, else returned as it is (calls then share its connection).
    """
    base = connection_keys(store)
    if isinstance(base, dist.TCPStore):
        return dist.TCPStore(
            base.host,
            base.port,
            is_master=False,
            timeout=timeout,
            wait_for_workers=False,
        )
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    own: dist.Store = clone()
    own.set_timeout(timeout)
    return own


SAFE_STORE_TORCH = "2.7"
"""torch 2.5 and 2.6 build a ``TCPStore`` with the GIL released for the whole of its
pybind11 constructor, the registration of the new Python object in pybind11's table of
instances included (pytorch#143593, fixed in 2.7). A store built on one thread while
another thread makes or frees a pybind11 object (the ``Work`` of a collective, a store)
corrupts that table, and the process aborts later ("Tried to deallocate unregistered
instance")."""


def store_built_unsafely() -> bool:
    """Whether building a ``TCPStore`` beside a thread that uses ``torch.distributed`` can
    abort the process on this torch (:data:`SAFE_STORE_TORCH`)."""
    return bool(torch.__version__ < SAFE_STORE_TORCH)


NAMED_GLOO_TORCH = "2.13"
"""The first release checked to name gloo's worker threads (``pt_gloo_runloop``). torch
2.5.1, 2.6.0, 2.7.0 and 2.10.0 leave them with the name of the thread that started them,
which is the main thread's."""


def gloo_threads_named() -> bool:
    """Whether this torch names gloo's worker threads (:data:`NAMED_GLOO_TORCH`)."""
    return bool(torch.__version__ >= NAMED_GLOO_TORCH)


def preserve_version_counters(
    tensors: tuple[torch.Tensor, ...],
) -> contextlib.AbstractContextManager[Any]:
    """A context that restores the tensors' autograd version counters when it exits.

    torch 2.10 takes the tuple at once; torch 2.6 and older take one tensor, so each gets
    its own context there (:func:`_preserve_one_by_one`).
    """
    preserve = torch.autograd.grad_mode._unsafe_preserve_version_counter
    try:
        return preserve(tensors)
    except (AttributeError, AssertionError, TypeError):  # one tensor only
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
    from torch 2.5 to 2.15."""
    return int(torch._C._storage_Use_Count(storage._cdata))


def unflatten_views(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the 1-D ``flat``, one per tensor in order, each ``flat.narrow(...).view(shape)``
    of its tensor's shape: one call of torch's private C++ ``unflatten_dense_tensors``
    (behind ``torch._utils._unflatten_dense_tensors``), present from torch 2.5 to 2.15."""
    return list(torch._C._nn.unflatten_dense_tensors(flat, tensors))


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


check_torch()  # at import bucketddp, which imports this module first
warn_if_untested("torch", str(torch.__version__))
