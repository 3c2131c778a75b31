"""Snapshots written by a node's writers read back equal, as values and layouts change.

Two writers of one node (two local ranks, here in one process) each copy their share of
the same state into a folder; the snapshot read back must equal the state, bit for bit,
after a step that changes only values (the writers reuse their layout and views) and after
one that changes shapes and dtypes (they deal the tensors again). A writer whose commits
run behind never removes its last committed snapshot.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from bucketddp.elastic import snapshots
from bucketddp.elastic.files import checksum, scan
from bucketddp.elastic.folder import Folder
from bucketddp.elastic.job import Job
from bucketddp.elastic.resume import read
from bucketddp.elastic.snapshots import Writer


def _state(seed: int, wide: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(6, 4 if not wide else 5, generator=g, requires_grad=True)
    return {
        "weight": weight,
        "tied": weight,  # the same tensor twice travels once
        "transposed": torch.randn(5, 3, generator=g).t(),  # not contiguous
        "mask": torch.rand(7, generator=g) > 0.5,
        "count": torch.tensor(seed, dtype=torch.int64),
        "phase": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
        "empty": torch.zeros(0, 3),
        "half": torch.randn(9, generator=g).to(torch.float16 if not wide else torch.bfloat16),
        "step": seed,
    }


KEY = bytes(range(32))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.resolve_conj(), b.resolve_conj())
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def test_each_snapshot_reads_back_equal_as_values_and_layouts_change(tmp_path: Path) -> None:
    folder = Folder.open(tmp_path / "snapshots")
    writers = [Writer(Job("run", 0, 0, rank, 2, rank, 2), folder, KEY) for rank in range(2)]
    try:
        states = [_state(1), _state(2), _state(3, wide=True), _state(4, wide=True)]
        for step, state in enumerate(states, start=1):
            for w in writers:
                w.take(step, state, own={"rank": w.job.rank})
            for w in writers:
                w.wait()
            newest = scan(folder, KEY)[0]
            assert newest.step == step
            got, owns = read(folder, newest)
            assert _same(state, got), f"step {step}"
            assert got["tied"] is got["weight"]
            assert sorted(owns) == [0, 1]
    finally:
        for w in writers:
            w.close()


def test_a_writer_behind_keeps_its_last_committed_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The commit thread held (a busy machine) after step 1's commit: step 2's is in flight
    # when step 3 is taken. A rank killed now must still hold step 1; so take(3) waits for
    # step 2's commit before it removes step 1's meta, and never leaves the rank with none.
    release = threading.Event()
    commits = 0

    def held_checksum(data: torch.Tensor) -> int:
        nonlocal commits
        commits += 1
        if commits > 1:
            assert release.wait(timeout=30)
        return checksum(data)

    monkeypatch.setattr(snapshots, "checksum", held_checksum)
    folder = Folder.open(tmp_path / "snapshots")
    writer = Writer(Job("run", 0, 0, 0, 1, 0, 1), folder, KEY)
    try:
        writer.take(1, _state(1))
        writer.wait()
        writer.take(2, _state(2))
        third = threading.Thread(target=writer.take, args=(3, _state(3)))
        third.start()
        third.join(timeout=0.5)
        assert third.is_alive(), "step 3 did not wait for step 2's commit"
        assert [s.step for s in scan(folder, KEY)] == [1]
        release.set()
        third.join(timeout=30)
        writer.wait()
        assert [s.step for s in scan(folder, KEY)] == [3, 2]
    finally:
        release.set()
        writer.close()


def test_late_tensors_are_copied_behind_and_settle_waits_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The optimizer's tensors (``late``) are copied by the writer's thread, held here: the
    # step goes on (take returns), what a forward changes was copied at once, and settle()
    # (before the next optimizer step) returns only once the late copy is done.
    release = threading.Event()
    copy = snapshots.Copies.run

    def held_copy(copies: snapshots.Copies) -> None:
        if threading.current_thread() is not threading.main_thread():
            assert release.wait(timeout=30)
        copy(copies)

    monkeypatch.setattr(snapshots.Copies, "run", held_copy)
    state = _state(1)
    before = {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    writer = Writer(Job("run", 0, 0, 0, 1, 0, 1), Folder.open(tmp_path / "snapshots"), KEY)
    try:
        writer.take(1, state, late={state["weight"].data_ptr()})
        state["count"].add_(5)  # a buffer a forward changes: copied already
        settling = threading.Thread(target=writer.settle)
        settling.start()
        settling.join(timeout=0.5)
        assert settling.is_alive(), "settle() returned before the late copy was done"
        release.set()
        settling.join(timeout=30)
        assert not settling.is_alive()
        state["weight"].detach().add_(1)  # the optimizer steps: after settle()
        writer.wait()
        got, _ = read(writer.folder, scan(writer.folder, KEY)[0])
        assert torch.equal(got["weight"], before["weight"])
        assert torch.equal(got["count"], before["count"])
    finally:
        release.set()
        writer.close()
