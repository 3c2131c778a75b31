"""Files planted in or beside a job's snapshot folder, for test_elastic_security.py.

Each planted meta would run code if it were unpickled: it makes the folder ``marker``
(``os.mkdir``). ``forged_meta`` is of this version's format, whole and newer than any
snapshot the job takes, but tagged with another key; ``old_format_meta`` is the pickled
format of earlier versions; ``fieldless_meta`` carries the job's own tag but no ``step``.
``after_step`` is what ``elastic_loop.py`` does after each step under ``ELASTIC_PLANT=1``:
rank 0 plants the three into its own folder after step 1, and records the mode of every
snapshot folder and file after step 3 and after the first step of a resumed attempt.
"""

from __future__ import annotations

import os
import pickle
import secrets
import stat
import zlib
from pathlib import Path
from typing import Any

from bucketddp.elastic import Elastic
from bucketddp.elastic.files import encode_meta

PLANTED = ("a7.n0.l0.s0.meta", "a7.n0.l1.s0.meta", "a7.n0.l0.s1.meta")


class _Mkdir:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.marker,))


def _payload(marker: str) -> dict[str, Any]:
    code = pickle.dumps(_Mkdir(marker))
    return {
        "format": 1,
        "step": 10**6,
        "phase": 1,
        "finished": True,
        "attempt": 7,
        "node": 0,
        "local_rank": 0,
        "local_world_size": 1,
        "rank": 0,
        "world_size": 2,
        "metas": [],
        "owners": [],
        "offsets": [],
        "nbytes": 0,
        "checksum": 0,
        "skeleton": code,
        "own": code,
    }


def forged_meta(marker: str) -> bytes:
    """A whole meta of the newest step, tagged with a key that is not the job's."""
    return encode_meta(_payload(marker), secrets.token_bytes(32))


def old_format_meta(marker: str) -> bytes:
    """A meta in the pickled format of earlier versions (magic, CRC, pickle)."""
    body = pickle.dumps(_payload(marker))
    return b"BDDPSNAP1\n" + zlib.crc32(body).to_bytes(4, "little") + body


def fieldless_meta(marker: str, key: bytes) -> bytes:
    """A meta with the job's tag that lacks its step."""
    payload = _payload(marker)
    del payload["step"]
    return encode_meta(payload, key)


def modes(top: Path) -> list[str]:
    """``"<mode> <path>"`` for ``top`` and everything under it, skipping what the other rank
    removes while this one lists (its old meta, a temporary file it renames)."""
    lines = []
    for p in [top, *sorted(top.rglob("*"))]:
        try:
            lines.append(f"{stat.S_IMODE(p.lstat().st_mode):04o} {p}")
        except FileNotFoundError:
            continue
    return lines


_recorded: list[int] = []


def after_step(job: Elastic, out: str, attempt: int) -> None:
    """Rank 0's planting and recording (see the module docstring)."""
    session = job.session
    assert session is not None
    folder, key = session._open()
    marker = f"{out}/marker"
    if attempt == 0 and job.steps == 1:
        folder.write(PLANTED[0], forged_meta(marker))
        folder.write(PLANTED[1], old_format_meta(marker))
        folder.write(PLANTED[2], fieldless_meta(marker, key))
    if attempt not in _recorded and (attempt > 0 or job.steps == 3):
        _recorded.append(attempt)
        assert session._writer is not None
        session._writer.wait()
        with open(f"{out}/modes", "a") as f:
            print("\n".join(modes(folder.path.parent)), file=f)
