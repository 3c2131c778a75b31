"""docs/differences.md lists every way BucketDataParallel's constructor differs from torch
DDP's, on the torch installed: each shared argument whose default differs, each argument
only one of them takes, and the keyword-only arguments. Its main tables are for the pinned
torch; on another release, what differs beyond them must be a row of "On older torch"."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from bucketddp import BucketDataParallel
from compat import pinned  # tools/compat.py: what constraints.txt pins

ROOT = Path(__file__).resolve().parents[2]

PAGE = ROOT / "docs" / "differences.md"
ON_PINNED = torch.__version__.split("+")[0] == pinned("torch")
"""Whether the torch installed is the pinned one, which the page's main tables are for."""


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    found = dict(inspect.signature(cls.__init__).parameters)  # type: ignore[misc]
    found.pop("self")
    return found


def _rows(section: str) -> dict[str, list[str]]:
    """The rows of the tables under ``## section``: first cell's name, then the cells."""
    text = PAGE.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.fullmatch(r"`(\w+)`", cells[0]) if line.startswith("|") else None
        if name:
            rows[name[1]] = cells[1:]
    return rows


def test_every_default_that_differs_is_on_the_page() -> None:
    ours, torch_ddp = _parameters(BucketDataParallel), _parameters(DistributedDataParallel)
    listed, older = _rows("Defaults"), _rows("On older torch")
    differ = {
        name: (torch_ddp[name].default, p.default)
        for name, p in ours.items()
        if name in torch_ddp and p.default != torch_ddp[name].default
    }
    if ON_PINNED:
        assert set(differ) == set(listed), f"defaults that differ {differ}, listed {set(listed)}"
    else:
        beyond = set(differ) - set(listed)
        assert beyond <= set(older), f"defaults that differ {differ}, listed {set(listed)}"
    for name, (theirs, mine) in differ.items():
        cells = listed.get(name) or older[name]
        if ON_PINNED:
            assert cells[0].startswith(f"`{theirs!r}`"), (name, theirs, cells)
        assert cells[1].startswith(f"`{mine!r}`"), (name, mine, cells)


def test_every_argument_only_one_of_them_takes_is_on_the_page() -> None:
    ours, torch_ddp = _parameters(BucketDataParallel), _parameters(DistributedDataParallel)
    listed, older = _rows("Arguments"), _rows("On older torch")
    assert {n for n in torch_ddp if n not in ours} <= set(listed)
    allowed = set(listed) if ON_PINNED else set(listed) | set(older)
    assert {n for n in ours if n not in torch_ddp} <= allowed
    for name, cells in listed.items():  # no stale rows: each names an argument that differs
        assert not (name in ours and name in torch_ddp), name
        # An older torch may lack an argument that only the pinned one takes.
        assert name in ours or name in torch_ddp or not ON_PINNED, name
        if name in ours:
            assert cells[0].startswith(f"`{ours[name].default!r}`"), (name, cells)


def test_the_older_torch_rows_are_alike_on_the_pinned_torch() -> None:
    """Each row of "On older torch" names an argument of ours, with its default; on the
    pinned torch, both constructors take it with that default (else it is a main row)."""
    ours, torch_ddp = _parameters(BucketDataParallel), _parameters(DistributedDataParallel)
    older = _rows("On older torch")
    assert older, "the page has no table under ## On older torch"
    for name, cells in older.items():
        assert cells[1].startswith(f"`{ours[name].default!r}`"), (name, cells)
        if ON_PINNED:
            assert name in torch_ddp, name
            assert torch_ddp[name].default == ours[name].default, name
