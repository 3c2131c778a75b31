"""Taking a snapshot at a step boundary: each rank of a node copies its share to shared memory.

The state (any object holding tensors: a Lightning checkpoint, a dict of state dicts) is
taken apart as ``checkpoint.py`` does to send it: a skeleton (the object pickled with each
tensor replaced by its index) and the tensors. Every rank of the node holds the same state
(data parallelism), so the tensors are dealt among them, largest first to the least loaded,
and each copies only its share, straight into a mapped shared-memory file: one copy, split
over the node's ranks. A background thread then checksums the share and writes the meta
that makes it count (``files.py``), off the step's critical path. At most one commit is in
flight: the next snapshot waits for it before it removes the older slot's meta, so a rank
killed at any moment holds its last committed snapshot.

The tensors that only an optimizer step changes (the parameters it updates, its state: the
caller names them, ``late``) are copied by that thread too, overlapping the next step's
forward and backward; the caller waits for that copy (``settle``) before the optimizer
steps again. The rest (buffers, which a forward changes) is copied at once.

The deal, and each slot's views of its file (one per tensor, of its dtype and shape), are
kept from one snapshot to the next while the tensors' shapes and dtypes stay the same:
then a snapshot copies its share with one ``_foreach_copy_``, with no per-tensor slicing.
"""

from __future__ import annotations

import atexit
import errno
import queue
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from ..skeleton import TensorMeta, split_tensors, to_bytes
from .files import Part, checksum, tables, write_meta
from .folder import Folder
from .job import Job
from .room import no_room

ALIGN = 64  # bytes: every tensor starts on such a boundary in a data file
FORMAT = 1


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def deal(metas: list[TensorMeta], ways: int) -> tuple[list[int], list[int], list[int]]:
    """Each tensor's writer and offset, and each writer's bytes: largest tensors first,
    each to the writer with the fewest bytes so far (ties to the lowest)."""
    owners = [0] * len(metas)
    offsets = [0] * len(metas)
    loads = [0] * ways
    for i in sorted(range(len(metas)), key=lambda i: (-metas[i].nbytes, i)):
        w = min(range(ways), key=lambda w: (loads[w], w))
        owners[i], offsets[i] = w, loads[w]
        loads[w] += _aligned(metas[i].nbytes)
    return owners, offsets, loads


@dataclass(frozen=True)
class Layout:
    """The deal of one state's tensors over a node's writers (see ``deal``)."""

    metas: list[TensorMeta]
    owners: list[int]
    offsets: list[int]
    loads: list[int]
    tables: str  # the metas, owners and offsets as a meta's JSON (``files.tables``)

    @classmethod
    def of(cls, metas: list[TensorMeta], ways: int) -> Layout:
        """The deal of tensors like ``metas`` over ``ways`` writers."""
        owners, offsets, loads = deal(metas, ways)
        table = tables({"metas": metas, "owners": owners, "offsets": offsets})
        return cls(metas, owners, offsets, loads, table)

    def mine(self, tensors: list[torch.Tensor], writer: int) -> list[torch.Tensor]:
        """The tensors ``writer`` copies, in index order."""
        return [t for t, owner in zip(tensors, self.owners, strict=True) if owner == writer]

    def views(self, data: torch.Tensor, writer: int) -> list[torch.Tensor]:
        """Where ``writer``'s tensors go in its mapped bytes ``data``: a view of each tensor's
        dtype and shape (every offset is aligned to ``ALIGN`` bytes), in index order."""
        out = []
        for meta, owner, offset in zip(self.metas, self.owners, self.offsets, strict=True):
            if owner == writer:
                raw = data[offset : offset + meta.nbytes]
                out.append(raw.view(meta.dtype).view(meta.shape))
        return out


def map_bytes(folder: Folder, name: str, nbytes: int) -> torch.Tensor:
    """File ``name`` of ``folder`` (made or resized to ``nbytes``) mapped as a shared uint8
    tensor."""
    mapped = folder.map(name, nbytes, create=True)
    if mapped is None:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mapped, dtype=torch.uint8)


class Copies:
    """Tensors to copy into their places in a mapped file: one ``_foreach_copy_``, a few
    microseconds a tensor cheaper than a ``copy_`` each (612 tensors: 2.1 ms, not 2.7)."""

    def __init__(self) -> None:
        self.places: list[torch.Tensor] = []
        self.tensors: list[torch.Tensor] = []

    def add(self, place: torch.Tensor, t: torch.Tensor) -> None:
        """Copy ``t`` to ``place`` at ``run()``."""
        self.places.append(place)
        self.tensors.append(t)

    def run(self) -> None:
        """Do the copies (and let the tensors go)."""
        if self.places:
            with torch.no_grad():
                torch._foreach_copy_(self.places, self.tensors)
        self.places, self.tensors = [], []


class Writer:
    """Writes this rank's share of each snapshot into its node's snapshot folder."""

    def __init__(self, job: Job, folder: Folder, key: bytes) -> None:
        self.job = job
        self.folder = folder
        self.key = key
        self._maps: dict[int, torch.Tensor] = {}
        self._layout: Layout | None = None
        self._views: dict[int, list[torch.Tensor]] = {}  # slot -> this rank's tensors' places
        self._slot = 0
        self._done = [threading.Event(), threading.Event()]
        for event in self._done:
            event.set()
        self._copied = threading.Event()  # the last snapshot's late tensors are copied
        self._copied.set()
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="bucketddp-snapshots", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        self.committed: tuple[int, str] | None = None  # (step, meta) of the last commit
        self.waited = 0.0  # seconds ``settle`` has blocked in all (what the overlap left)

    def take(
        self,
        step: int,
        state: Any,
        own: Any = None,
        *,
        phase: int = 0,
        finished: bool = False,
        late: Collection[int] = (),
    ) -> None:
        """Snapshot ``state`` as of ``step``; ``own`` is this rank's own part (not shared);
        ``phase`` names the fit, ``finished`` marks the state at its end (``files.py``).
        The CPU tensors whose ``data_ptr()`` is in ``late`` (what only the optimizers change)
        are copied by the background thread: the caller must ``settle()`` before they
        change again."""
        slot = self._slot
        self._slot ^= 1
        # Every earlier commit must be finished before this slot's meta goes: else, with the
        # thread a step behind, a rank killed now would hold no snapshot at all.
        self.wait()
        part = Part(self.job.attempt, self.job.node, self.job.local_rank, slot)
        meta_name = part.name("meta")
        self.folder.remove(meta_name)
        skeleton, tensors, metas = split_tensors(state)
        layout = self._layout_of(metas)
        owners, offsets, loads = layout.owners, layout.offsets, layout.loads
        me = self.job.local_rank
        data = self._map(slot, part, loads[me])
        views = self._views.get(slot)
        if views is None:
            views = self._views[slot] = layout.views(data, me)
        now, deferred = Copies(), Copies()
        for view, t in zip(views, layout.mine(tensors, me), strict=True):
            later = t.is_cpu and t.data_ptr() in late
            (deferred if later else now).add(view, t)
        now.run()
        payload = {
            "format": FORMAT,
            "step": step,
            "attempt": self.job.attempt,
            "node": self.job.node,
            "local_rank": me,
            "local_world_size": self.job.local_world_size,
            "rank": self.job.rank,
            "world_size": self.job.world_size,
            "phase": phase,
            "finished": finished,
            "skeleton": skeleton,
            "metas": layout.metas,
            "owners": owners,
            "offsets": offsets,
            "tables": layout.tables,
            "nbytes": loads[me],
            "own": to_bytes(own),
        }
        self._done[slot].clear()
        if deferred.places:
            self._copied.clear()
        self._queue.put(lambda: self._commit(slot, meta_name, data, payload, deferred))

    def _layout_of(self, metas: list[TensorMeta]) -> Layout:
        """The deal of tensors like ``metas``: the last one's if they are alike."""
        if self._layout is None or self._layout.metas != metas:
            self._layout = Layout.of(metas, self.job.local_world_size)
            self._views.clear()
        return self._layout

    def _map(self, slot: int, part: Part, nbytes: int) -> torch.Tensor:
        mapped = self._maps.get(slot)
        if mapped is None or mapped.numel() != nbytes:
            try:
                mapped = map_bytes(self.folder, part.name("data"), nbytes)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                raise no_room(self.folder.path, nbytes, e) from None
            self._maps[slot] = mapped
            self._views.pop(slot, None)
        return mapped

    def _commit(
        self,
        slot: int,
        name: str,
        data: torch.Tensor,
        payload: dict[str, Any],
        deferred: Copies,
    ) -> None:
        try:
            try:
                deferred.run()
            finally:
                self._copied.set()
            payload["checksum"] = checksum(data)
            write_meta(self.folder, name, payload, self.key)
            self.committed = (payload["step"], name)
        finally:
            self._done[slot].set()

    def _work(self) -> None:
        while (task := self._queue.get()) is not None:
            try:
                task()
            except Exception as e:  # a snapshot that cannot be written is not one
                print(f"bucketddp: a snapshot could not be written: {e!r}", flush=True)

    def settle(self) -> None:
        """Wait until the last snapshot's tensors are all copied (its ``late`` ones too)."""
        if not self._copied.is_set():
            start = time.perf_counter()
            self._copied.wait()
            self.waited += time.perf_counter() - start

    def wait(self) -> None:
        """Wait until every snapshot taken so far is written."""
        for event in self._done:
            event.wait()

    def close(self) -> None:
        """Finish the writes in flight and stop the thread (also at exit)."""
        atexit.unregister(self.close)
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
