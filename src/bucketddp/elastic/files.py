"""A job's snapshot folder on one node: each writer's data and meta files, and what is complete.

A snapshot of step ``s`` is written by every rank of a node, each taking a share of the
tensors (see ``snapshots.py``). Rank ``l`` of node ``n`` in attempt ``a`` writes two files
per slot ``k`` (two slots, taken in turn, so the last complete snapshot survives a write
that dies half way):

- ``a{a}.n{n}.l{l}.s{k}.data``: its share of the tensors' raw bytes, a shared-memory file
  mapped as a byte tensor and kept mapped from one snapshot to the next;
- ``a{a}.n{n}.l{l}.s{k}.meta``: what the bytes are, written last, through a rename.

A meta also names its fit (``phase``: the first elastic fit of the script is 1, the next 2;
a restart resumes a fit only from that fit's snapshots) and says whether it is the state at
the fit's end (``finished``): a restart that finds it does no training step.

A meta is ``MAGIC``, an HMAC-SHA256 tag under the job's key (``secret.py``) of all that
follows, the length of a JSON header, the header (step, ranks, each tensor's dtype, shape
and place, the data's checksum) and the sections it lists: the skeleton of the state and
this rank's own part, both pickled. A meta is read only from a checked private folder
(``folder.py``), and its tag is checked before anything in it is parsed: a file this job
did not write is never unpickled. One that fails the tag, or is cut, or lacks a field, is
skipped with a warning naming it.

A writer removes its meta before it overwrites the data, so a meta always describes the
bytes beside it. A node's snapshot of step ``s`` is complete when every rank of the node
has a meta of step ``s``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..skeleton import TensorMeta
from .folder import Folder

log = logging.getLogger(__name__)

MAGIC = b"BDDPSNAP2\n"
_TAG = 32  # bytes of an HMAC-SHA256
_NAME = re.compile(r"^a(\d+)\.n(\d+)\.l(\d+)\.s(\d)\.meta$")
_INTS = "format step phase attempt node local_rank local_world_size rank world_size nbytes checksum"
_INT_LISTS = ("owners", "offsets")
_SECTIONS = ("skeleton", "own")
_warned: set[tuple[str, str]] = set()


class BadMeta(ValueError):
    """A meta file that is not one this job wrote whole."""


@dataclass(frozen=True)
class Part:
    """One writer's file pair in one slot."""

    attempt: int
    node: int
    local_rank: int
    slot: int

    def name(self, suffix: str) -> str:
        """The part's ``.data`` or ``.meta`` file name."""
        return f"a{self.attempt}.n{self.node}.l{self.local_rank}.s{self.slot}.{suffix}"


def data_name(meta_name: str) -> str:
    """The data file beside meta ``meta_name``."""
    return meta_name.removesuffix(".meta") + ".data"


_TABLES = ("metas", "owners", "offsets")


def tables(payload: dict[str, Any]) -> str:
    """A meta's tensor tables (each tensor's dtype, shape and place) as JSON object members:
    the bulk of a meta's header, the same from one snapshot to the next while the layout
    stays (``snapshots.Layout`` keeps them, for ``encode_meta``'s ``"tables"``)."""
    found: dict[str, Any] = {k: payload[k] for k in _TABLES if k in payload}
    found["metas"] = [
        [str(m.dtype), list(m.shape), m.parameter, m.requires_grad]
        for m in payload.get("metas", [])
    ]
    return json.dumps(found, separators=(",", ":"))[1:-1]


def encode_meta(payload: dict[str, Any], key: bytes) -> bytes:
    """The bytes of a meta holding ``payload`` (the fields ``decode_meta`` checks); its
    tables are ``payload["tables"]`` if given, else made from its metas, owners, offsets."""
    skip = {*_SECTIONS, *_TABLES, "tables"}
    header = {k: v for k, v in payload.items() if k not in skip}
    sections = [payload[k] for k in _SECTIONS if k in payload]
    header["sections"] = [[k, len(payload[k])] for k in _SECTIONS if k in payload]
    members = payload.get("tables") or tables(payload)
    rest = json.dumps(header, separators=(",", ":"))  # at least {"sections":[]}
    head = ("{" + members + "," + rest[1:]).encode()
    body = len(head).to_bytes(4, "little") + head + b"".join(sections)
    return MAGIC + hmac.new(key, body, hashlib.sha256).digest() + body


def _dtype(name: object) -> torch.dtype:
    found = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(found, torch.dtype):
        raise BadMeta(f"unknown dtype {name!r}")
    return found


def _tensor_meta(entry: object) -> TensorMeta:
    if not isinstance(entry, list) or len(entry) != 4:
        raise BadMeta(f"a tensor entry is {entry!r}")
    dtype, shape, parameter, requires_grad = entry
    if (
        not _int_list(shape)
        or not isinstance(parameter, bool)
        or not isinstance(requires_grad, bool)
    ):
        raise BadMeta(f"a tensor entry is {entry!r}")
    return TensorMeta(_dtype(dtype), tuple(shape), parameter, requires_grad)


def _int_list(value: object) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def decode_meta(raw: bytes, key: bytes) -> dict[str, Any]:
    """The payload of a meta ``encode_meta`` wrote with ``key``; ``BadMeta`` for anything
    else. The tag is checked before any of the rest is parsed."""
    head = len(MAGIC) + _TAG
    if not raw.startswith(MAGIC):
        raise BadMeta("not a snapshot meta of this version")
    if len(raw) < head + 4:
        raise BadMeta("it is cut short")
    body = raw[head:]
    if not hmac.compare_digest(
        raw[len(MAGIC) : head], hmac.new(key, body, hashlib.sha256).digest()
    ):
        raise BadMeta("its tag does not check: this job did not write it")
    try:
        return _parse(body)
    except (TypeError, ValueError, KeyError) as e:  # BadMeta is a ValueError
        raise BadMeta(str(e)) from None


def _parse(body: bytes) -> dict[str, Any]:
    """The fields of an authenticated meta's body, each checked."""
    size = int.from_bytes(body[:4], "little")
    header = json.loads(body[4 : 4 + size])
    if not isinstance(header, dict):
        raise BadMeta("its header is not a JSON object")
    for field in _INTS.split():
        if type(header.get(field)) is not int:
            raise BadMeta(f"field {field!r} is missing or not an integer")
    for field in _INT_LISTS:
        if not _int_list(header.get(field)):
            raise BadMeta(f"field {field!r} is missing or not a list of integers")
    if type(header.get("finished")) is not bool:
        raise BadMeta("field 'finished' is missing or not a boolean")
    if not isinstance(header.get("metas"), list):
        raise BadMeta("field 'metas' is missing or not a list")
    header["metas"] = [_tensor_meta(e) for e in header["metas"]]
    lengths = dict(header.pop("sections", None) or [])
    at = 4 + size
    for name in _SECTIONS:
        n = lengths.get(name)
        if type(n) is not int or n < 0 or at + n > len(body):
            raise BadMeta(f"section {name!r} is missing or cut")
        header[name] = body[at : at + n]
        at += n
    return header


def write_meta(folder: Folder, name: str, payload: dict[str, Any], key: bytes) -> None:
    """Write meta ``name`` whole or not at all."""
    folder.write(name, encode_meta(payload, key))


def read_meta(folder: Folder, name: str, key: bytes) -> dict[str, Any] | None:
    """The payload of meta ``name``, or None (with one warning per file and reason) if it
    is missing, cut, fails its tag, or lacks a field."""
    try:
        return decode_meta(folder.read(name), key)
    except FileNotFoundError:
        return None
    except (OSError, BadMeta) as e:
        where = str(folder.path / name)
        if (where, str(e)) not in _warned:
            _warned.add((where, str(e)))
            log.warning("bucketddp: skipping snapshot meta %s: %s", where, e)
        return None


def checksum(data: torch.Tensor) -> int:
    """A cheap checksum of a byte tensor whose length is a multiple of 8."""
    return int(data.view(torch.int64).sum().item()) if data.numel() else 0


@dataclass(frozen=True)
class Snapshot:
    """A node's complete snapshot of one step, as found in the folder."""

    attempt: int
    node: int
    step: int
    metas: dict[int, dict[str, Any]]  # local rank -> its meta (and its file's "name")
    finished: bool = False  # the state at the fit's end (``Session.finish``)
    phase: int = 0  # which elastic fit of the script took it (1 for the first)

    @property
    def key(self) -> tuple[int, bool, int, int]:
        """(step, finished, attempt, node): newest first when sorted in reverse (the end of
        a fit before a snapshot of its last step)."""
        return (self.step, self.finished, self.attempt, self.node)


def scan(folder: Folder, key: bytes) -> list[Snapshot]:
    """The complete snapshots in ``folder``, newest first."""
    found: dict[tuple[int, int, bool, int, int], dict[int, dict[str, Any]]] = {}
    for name in folder.names():
        match = _NAME.match(name)
        if match is None:
            continue
        meta = read_meta(folder, name, key)
        if meta is None:
            continue
        named = tuple(int(g) for g in match.groups()[:3])
        if named != (meta["attempt"], meta["node"], meta["local_rank"]):
            continue  # a meta of this job's, under another writer's name
        which = (meta["phase"], meta["step"], meta["finished"], meta["attempt"], meta["node"])
        found.setdefault(which, {})[meta["local_rank"]] = {**meta, "name": name}
    out = []
    for (phase, step, finished, attempt, node), metas in found.items():
        width = {m["local_world_size"] for m in metas.values()}
        if len(width) == 1 and set(metas) == set(range(width.pop())):
            out.append(Snapshot(attempt, node, step, metas, finished, phase))
    return sorted(out, key=lambda s: s.key, reverse=True)


_SNAPSHOT_FILE = re.compile(r".*\.(meta|data)(\.\d+\.tmp)?")  # with a meta's write in flight


def remove_except(folder: Folder, keep: Iterable[str]) -> None:
    """Remove every snapshot file in ``folder`` (a ``.meta``, a ``.data``, a meta's
    unfinished write) but the metas ``keep`` and their data. Other files stay, written or
    in flight: another rank's exit mark (``ending.py``) may be on its way in."""
    kept = set(keep)
    kept |= {data_name(k) for k in kept}
    for name in folder.names():
        if name not in kept and _SNAPSHOT_FILE.fullmatch(name):
            folder.remove(name)
