"""Python's cyclic garbage collector held off while a snapshot is taken.

Taking a snapshot makes a few Python objects per tensor (the state dicts' detached tensors,
the skeleton's bookkeeping), nearly all gone when the snapshot call returns. With the
collector running, every 700 of them alive at once start a collection, and those alive then
are promoted; promoted objects add up until Python collects every object of the process.
On the deep transformer benchmark (612 tensors, about 300,000 Python objects) that was
three young collections per snapshot and a full one every 40 snapshots, about 190 ms each:
5 ms per step on average, more than the rest of the snapshot's Python. Held off during the
call, the collector finds them gone when it runs again, and promotes none of them.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def held_off() -> Iterator[None]:
    """No cyclic collection inside the block; the collector is on again after it, if it was
    on before (another thread's ``gc.disable()`` meanwhile is undone)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
