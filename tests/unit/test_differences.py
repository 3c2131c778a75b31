"""docs/differences.md lists every way BucketDataParallel's constructor differs from torch
DDP's, on the torch installed: each shared argument whose default differs, each argument
only one of them takes, and the keyword-only arguments."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from torch.nn.parallel import DistributedDataParallel

from bucketddp import BucketDataParallel

PAGE = Path(__file__).resolve().parents[2] / "docs" / "differences.md"


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
    listed = _rows("Defaults")
    differ = {
        name: (torch_ddp[name].default, p.default)
        for name, p in ours.items()
        if name in torch_ddp and p.default != torch_ddp[name].default
    }
    assert set(differ) == set(listed), f"defaults that differ {differ}, listed {set(listed)}"
    for name, (theirs, mine) in differ.items():
        assert listed[name][0].startswith(f"`{theirs!r}`"), (name, theirs, listed[name])
        assert listed[name][1].startswith(f"`{mine!r}`"), (name, mine, listed[name])


def test_every_argument_only_one_of_them_takes_is_on_the_page() -> None:
    ours, torch_ddp = _parameters(BucketDataParallel), _parameters(DistributedDataParallel)
    listed = _rows("Arguments")
    assert {n for n in torch_ddp if n not in ours} <= set(listed)
    assert {n for n in ours if n not in torch_ddp} <= set(listed)
    for name, cells in listed.items():  # no stale rows: each names an argument that differs
        assert (name in ours) != (name in torch_ddp), name
        if name in ours:
            assert cells[0].startswith(f"`{ours[name].default!r}`"), (name, cells)


def test_the_keyword_only_arguments_are_on_the_page() -> None:
    ours = _parameters(BucketDataParallel)
    positional = [n for n, p in ours.items() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert positional == ["module"]
    assert "All arguments but `module` are keyword-only" in PAGE.read_text()
