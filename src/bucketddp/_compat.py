"""What differs between the torch releases bucketddp supports, each behind one function.

Every torch or Lightning API that some supported release lacks, or spells differently,
is reached through this module, with one fallback each, so that a version bump touches
one file and no version checks are scattered through the package.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def base_store(store: dist.Store) -> dist.Store:
    """The store under any ``PrefixStore`` wrappers of ``store``."""
    while isinstance(store, dist.PrefixStore):
        inner = getattr(store, "underlying_store", None)
        if inner is None:  # a release without the attribute: stop at the prefix store
            return store
        store = inner
    return store


def store_connection(store: dist.Store, timeout: timedelta) -> dist.Store:
    """A new client connection to the server behind ``store``, for another thread's calls.

    A ``TCPStore`` (under any prefixes) gets a new ``TCPStore`` client to the same host and
    port, which gives up connecting after ``timeout`` (``Store.clone()`` would wait the
    process group's whole timeout, and exists only on newer releases). Keys are not
    prefixed as ``store``'s are: the caller picks its own. Any other store is cloned where
    this torch can, else returned as it is (calls then share its connection).
    """
    base = base_store(store)
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
