"""After a restart: find the newest complete snapshot on any node, agree on it, send it to all.

One collective call (``restore``). The first rank of each node lists the complete snapshots
in its node's folder (reading its metas once per restore); the ranks agree on the newest
(at an unchanged world size, the newest whose ranks' own parts are all still there, so
every rank gets its own RNG state back); its holder reads it, checks every share's size
and checksum, and sends it with ``checkpoint.broadcast_checkpoint``. A snapshot that fails
the check is never loaded: the ranks go on to the next newest, and return None when there
is none. Only metas that check with the job's key count (``files.py``): the pickled parts
are never read from any other.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import broadcast_checkpoint
from ..comm import global_rank
from ..skeleton import from_bytes, join_tensors
from .disk import Disk
from .files import Snapshot, checksum, data_name, remove_except, scan
from .folder import Folder
from .job import Job

log = logging.getLogger(__name__)


class CorruptSnapshot(RuntimeError):
    """A snapshot's files do not hold what its metas say."""


@dataclass
class Restored:
    """What ``restore`` returns: the state, the step, and this rank's own part (or None)."""

    state: Any
    step: int
    own: Any
    world_size: int  # the world size the snapshot was taken at
    source: str  # where it came from, for the log
    finished: bool = False  # the state at the fit's end: no training step is left
    scanned: list[Snapshot] = field(default_factory=list, repr=False)  # this node's, if listed


def read(folder: Folder, snapshot: Snapshot) -> tuple[Any, dict[int, bytes]]:
    """The state a node's snapshot holds, and each writer's own part by its global rank."""
    metas = snapshot.metas
    first = metas[0]
    shape = [(m["skeleton"], m["metas"], m["owners"], m["offsets"]) for m in metas.values()]
    if any(s != shape[0] for s in shape):
        raise CorruptSnapshot(f"the ranks of node {snapshot.node} wrote different states")
    shares = {}
    for local, meta in metas.items():
        name, nbytes = data_name(meta["name"]), meta["nbytes"]
        try:
            mapped = folder.map(name, nbytes, create=False)
        except OSError as e:
            raise CorruptSnapshot(f"{folder.path / name} is missing or short ({e})") from None
        data = torch.empty(0, dtype=torch.uint8)
        if mapped is not None:
            data = torch.frombuffer(mapped, dtype=torch.uint8)
        if checksum(data) != meta["checksum"]:
            raise CorruptSnapshot(f"{folder.path / name} fails its checksum")
        shares[local] = data
    tensors = []
    for meta, owner, offset in zip(first["metas"], first["owners"], first["offsets"], strict=True):
        raw = shares[owner][offset : offset + meta.nbytes]
        tensors.append(raw.view(meta.dtype).view(meta.shape).clone())
    state = join_tensors(first["skeleton"], tensors, first["metas"])
    return state, {m["rank"]: m["own"] for m in metas.values()}


Key = tuple[int, bool, int, int]  # a snapshot's (step, finished, attempt, node)
Listed = tuple[Key, bool, bool, list[int], int]  # key, on disk, loadable, writers, world


def _entry(s: Snapshot, on_disk: bool, loadable: bool) -> Listed:
    writers = sorted(m["rank"] for m in s.metas.values())
    return (s.key, on_disk, loadable, writers, s.metas[0]["world_size"])


@dataclass
class _Scanned:
    """What this rank read of the folders once, at the start of a restore: its node's
    snapshots (on the node's first rank) and the disk folder's (on rank 0), those with
    node 0's data among them."""

    here: list[Snapshot]
    disk: list[Snapshot]
    disk_whole: list[Snapshot]

    @classmethod
    def read(cls, job: Job, folder: Folder, key: bytes, disk: Disk | None) -> _Scanned:
        """Scan this rank's folders (see the class docstring)."""
        here = scan(folder, key) if job.local_rank == 0 else []
        whole, every = disk.snapshots(key) if disk is not None and job.rank == 0 else ([], [])
        return cls(here, every, whole)

    def listing(self, phase: int) -> list[Listed]:
        """The snapshots of fit ``phase`` (the disk's without node 0's data only lend their
        own parts)."""
        out = [_entry(s, False, True) for s in self.here if s.phase == phase]
        return out + [_entry(s, True, s in self.disk_whole) for s in self.disk if s.phase == phase]

    def owns(self, which: tuple[int, int, bool]) -> dict[int, bytes]:
        """The own parts of the ranks in the snapshots ``which`` (phase, step, finished)."""
        return {
            m["rank"]: m["own"]
            for s in self.here + self.disk
            if (s.phase, s.step, s.finished) == which
            for m in s.metas.values()
        }


Candidate = tuple[Key, bool]  # a snapshot's key, and whether it is read from the disk


def _candidates(everyone: list[list[Listed]], world: int) -> list[tuple[Candidate, int]]:
    """Each loadable snapshot with its holder (the lowest rank that lists it), best first:
    whole (every old rank's own part there, at an unchanged world size), newest, a node's
    before the disk's."""
    holders: dict[Candidate, int] = {}
    info: dict[Key, int] = {}  # key -> old world size
    covered: dict[tuple[int, bool], set[int]] = {}  # (step, finished) -> old ranks' own parts
    for rank, listing in enumerate(everyone):
        for which, on_disk, loadable, writers, old_world in listing:
            if loadable:
                holders.setdefault((which, on_disk), rank)
            info[which] = old_world
            covered.setdefault(which[:2], set()).update(writers)

    def rank_of(candidate: Candidate) -> tuple[bool, int, bool, bool, int, int]:
        (step, finished, attempt, node), on_disk = candidate
        old_world = info[candidate[0]]
        whole = covered[(step, finished)] >= set(range(old_world)) and old_world == world
        return (whole, step, finished, not on_disk, attempt, -node)

    return [(c, holders[c]) for c in sorted(holders, key=rank_of, reverse=True)]


def restore(
    job: Job,
    folder: Folder,
    key: bytes,
    group: dist.ProcessGroup | None = None,
    phase: int = 0,
    disk: Disk | None = None,
) -> Restored | None:
    """Find, agree on and load the newest readable snapshot of fit ``phase`` of this job in
    its checked ``folder`` or the ``disk`` folder, whose metas check with ``key`` (a
    collective)."""
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    scanned = _Scanned.read(job, folder, key, disk)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (job.attempt, scanned.listing(phase)), group=group)
    everyone = [listing for _, listing in gathered]
    for (which, on_disk), holder in _candidates(everyone, world):
        step, finished, attempt, node = which
        status: list[Any] = [None]
        found: Snapshot | None = None
        source = disk.open() if on_disk and disk is not None else folder
        if me == holder:
            listed = scanned.disk if on_disk else scanned.here
            found = next((s for s in listed if s.key == which and s.phase == phase), None)
            try:
                if found is None:
                    raise CorruptSnapshot("it went away")
                state, owns = read(source, found)
                status = [("ok", found.metas[0]["world_size"])]
            except Exception as e:
                state, owns = None, {}
                status = [("bad", repr(e))]
        dist.broadcast_object_list(status, src=global_rank(group, holder), group=group)
        if status[0][0] != "ok":
            if me == 0:
                why = status[0][1]
                log.warning(
                    "bucketddp: snapshot of step %d (node %d) is unusable: %s", step, node, why
                )
            continue
        old_world = status[0][1]
        state = broadcast_checkpoint(state if me == holder else None, group=group, src=holder)
        mine = {**scanned.owns((phase, step, finished)), **(owns if me == holder else {})}
        own = _gather_owns(job, old_world, mine, group)
        if me == holder and found is not None:
            log.info(
                "bucketddp: resuming from the snapshot of step %d (attempt %d, node %d)",
                step,
                attempt,
                node,
            )
        where = f"step {step}, attempt {attempt}, node {node}"
        if on_disk:
            where = f"step {step}, from the disk folder {source.path}"
        if finished:
            where = f"the end of the fit at {where}"
        return Restored(state, step, own, old_world, where, finished, scanned.here)
    # A restart of some node (a join leaves the new node at attempt 0, so ask them all).
    latest = max(attempt for attempt, _ in gathered)
    if latest > 0 and me == 0:
        print(
            f"bucketddp: attempt {latest} of this job found no usable snapshot on any node: "
            "training starts from the beginning",
            file=sys.stderr,
            flush=True,
        )
    return None


def _gather_owns(
    job: Job, old_world: int, owns: dict[int, bytes], group: dist.ProcessGroup | None
) -> Any:
    """This rank's own part, from the own parts ``owns`` each rank found (its node's, and
    the disk's on rank 0): the part the same rank wrote, if the old world had this rank
    (else None). At another world size, without its ``"hooks"`` entry: a communication
    hook's per-rank state (PowerSGD's warm-start memories) must match over the ranks, and
    starts afresh on every rank."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, owns, group=group)
    mine = next((o[job.rank] for o in everyone if job.rank in o), None)
    if mine is None:
        return None
    own = from_bytes(mine)
    if old_world != dist.get_world_size(group) and isinstance(own, dict):
        own.pop("hooks", None)
    return own


def keep_only(
    job: Job,
    folder: Folder,
    key: bytes,
    step: int,
    finished: bool = False,
    phase: int = 0,
    scanned: list[Snapshot] | None = None,
) -> None:
    """Remove this node's snapshot files of fit ``phase`` but those of ``step`` (the fit's
    end, with ``finished``), after resuming from it or finishing there; other fits' stay.
    ``scanned``: the folder's snapshots, if just read."""
    if job.local_rank != 0:
        return
    keep = [
        m["name"]
        for s in (scanned if scanned is not None else scan(folder, key))
        if s.phase != phase or (s.step, s.finished) == (step, finished)
        for m in s.metas.values()
    ]
    remove_except(folder, keep)
