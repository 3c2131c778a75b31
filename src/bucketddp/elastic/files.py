"""A job's snapshot folder on one node: each writer's data and meta files, and what is complete.

A snapshot of step ``s`` is written by every rank of a node, each taking a share of the
tensors (see ``snapshots.py``). Rank ``l`` of node ``n`` in attempt ``a`` writes two files
per slot ``k`` (two slots, taken in turn, so the last complete snapshot survives a write
that dies half way):

- ``a{a}.n{n}.l{l}.s{k}.data``: its share of the tensors' bytes, a shared-memory file
  mapped as a byte tensor and kept mapped from one snapshot to the next;
- ``a{a}.n{n}.l{l}.s{k}.meta``: what the bytes are (step, layout, checksum, the skeleton of
  the state and this rank's own part), written last, through a rename.

A writer removes its meta before it overwrites the data, so a meta always describes the
bytes beside it. A node's snapshot of step ``s`` is complete when every rank of the node
has a meta of step ``s``. A meta that fails its magic or CRC is ignored.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAGIC = b"BDDPSNAP1\n"
_NAME = re.compile(r"^a(\d+)\.n(\d+)\.l(\d+)\.s(\d)\.meta$")


@dataclass(frozen=True)
class Part:
    """One writer's file pair in one slot."""

    attempt: int
    node: int
    local_rank: int
    slot: int

    def path(self, directory: Path, suffix: str) -> Path:
        """The part's ``.data`` or ``.meta`` file in ``directory``."""
        stem = f"a{self.attempt}.n{self.node}.l{self.local_rank}.s{self.slot}"
        return directory / f"{stem}.{suffix}"


def write_meta(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` whole or not at all (a temporary file, then a rename)."""
    body = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + zlib.crc32(body).to_bytes(4, "little") + body)
    os.replace(tmp, path)


def read_meta(path: Path) -> dict[str, Any] | None:
    """The payload ``write_meta`` wrote, or None if the file is missing, cut or garbled."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    head = len(MAGIC) + 4
    if len(raw) < head or not raw.startswith(MAGIC):
        return None
    body = raw[head:]
    if zlib.crc32(body).to_bytes(4, "little") != raw[len(MAGIC) : head]:
        return None
    try:
        payload = pickle.loads(body)
    except Exception:
        return None
    return payload if isinstance(payload, dict) else None


def remove(path: Path) -> None:
    """Remove ``path`` if it exists."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def map_bytes(path: Path, nbytes: int) -> torch.Tensor:
    """``path`` (created or resized to ``nbytes``) mapped as a shared uint8 tensor."""
    with open(path, "ab") as f:
        f.truncate(nbytes)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def checksum(data: torch.Tensor) -> int:
    """A cheap checksum of a byte tensor whose length is a multiple of 8."""
    return int(data.view(torch.int64).sum().item()) if data.numel() else 0


@dataclass(frozen=True)
class Snapshot:
    """A node's complete snapshot of one step, as found in the folder."""

    attempt: int
    node: int
    step: int
    metas: dict[int, dict[str, Any]]  # local rank -> its meta

    @property
    def key(self) -> tuple[int, int, int]:
        """(step, attempt, node): newest first when sorted in reverse."""
        return (self.step, self.attempt, self.node)


def scan(directory: Path) -> list[Snapshot]:
    """The complete snapshots in ``directory``, newest first."""
    found: dict[tuple[int, int, int], dict[int, dict[str, Any]]] = {}
    if not directory.is_dir():
        return []
    for path in directory.iterdir():
        if _NAME.match(path.name) is None:
            continue
        meta = read_meta(path)
        if meta is None:
            continue
        key = (meta["step"], meta["attempt"], meta["node"])
        found.setdefault(key, {})[meta["local_rank"]] = {**meta, "path": str(path)}
    out = []
    for (step, attempt, node), metas in found.items():
        width = {m["local_world_size"] for m in metas.values()}
        if len(width) == 1 and set(metas) == set(range(width.pop())):
            out.append(Snapshot(attempt, node, step, metas))
    return sorted(out, key=lambda s: s.key, reverse=True)


def remove_except(directory: Path, keep: Iterable[Path]) -> None:
    """Remove every snapshot file in ``directory`` but ``keep`` (and their data files)."""
    kept = {str(p) for p in keep} | {str(Path(p).with_suffix(".data")) for p in keep}
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if str(path) not in kept and path.suffix in (".meta", ".data", ".tmp"):
            remove(path)
