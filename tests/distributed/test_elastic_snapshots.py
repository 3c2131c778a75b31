"""Snapshots on real process groups: what is kept, what is refused, and that jobs never mix.

The ranks run under ``run_ranks`` with the variables torchrun would set (run id, attempt,
node, local ranks) and a snapshot folder of the test's own. A "restart" is a new Session
with a higher attempt number, in the same processes: what it reads is only what the files
hold.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bucketddp.elastic.files import scan
from bucketddp.elastic.session import Session
from multirank import run_ranks


def _env(root: Path, run: str) -> dict[str, str]:
    return {
        "BUCKETDDP_SNAPSHOT_DIR": str(root),
        "TORCHELASTIC_RUN_ID": run,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "GROUP_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
    }


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"w": torch.randn(300, 70), "b": torch.randn(5), "step": step, "note": f"s{step}"}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k] for k, v in a.items()
    )


def _restart() -> Session:
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(
        int(os.environ["TORCHELASTIC_RESTART_COUNT"]) + 1
    )
    return Session()


def _write_then_restore(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    session = Session()
    for step in range(1, 6):
        session.take(step, _state(step), own={"rank": rank, "step": step})
    session._writer.wait()  # type: ignore[union-attr]
    dist.barrier()
    folder = session.job.directory()
    out["complete"] = [s.step for s in scan(*session._open())]
    out["files"] = sorted(p.name for p in folder.iterdir())
    if rank == 0:  # garble one share of step 5's data: that snapshot must be refused
        data = next(p for p in folder.glob("a0.n0.l1.*.data") if "s0" in p.name)
        with open(data, "r+b") as f:
            f.seek(10)
            f.write(b"\xff\x00\xff")
    dist.barrier()
    restored = _restart().restore()
    assert restored is not None
    out["restored"] = (restored.step, _same(restored.state, _state(4)), restored.own)
    out["kept"] = [s.step for s in scan(*session._open())]  # the one resumed from, no more
    dist.barrier()
    if rank == 0:  # cut the meta of the snapshot left: nothing usable remains
        for meta in folder.glob("*.meta"):
            meta.write_bytes(meta.read_bytes()[:40])
    dist.barrier()
    out["after_cutting"] = _restart().restore()
    last = _restart()
    last.restore()
    last.finish()  # training is over: kept until every local rank has exited cleanly
    out["kept_after_finish"] = folder.exists()
    last._clean_exit.at_exit()  # what atexit runs at this rank's clean exit
    dist.barrier()
    out["left"] = folder.exists()
    return out


def test_two_snapshots_kept_and_a_bad_one_never_loaded(tmp_path: Path) -> None:
    env = _env(tmp_path, "job-a")
    r0, r1 = run_ranks(_write_then_restore, 2, env=env)
    # Two slots per rank, each a data file and a meta: the two newest snapshots.
    assert r0["complete"] == [5, 4]
    assert r0["files"] == [
        f"a0.n0.l{rank}.s{slot}.{kind}"
        for rank in (0, 1)
        for slot in (0, 1)
        for kind in ("data", "meta")
    ] + ["key"]
    # Step 5's shares fail the checksum: every rank falls back to step 4, the state and its
    # own part; once no meta is whole, there is nothing to resume from.
    assert r0["restored"] == (4, True, {"rank": 0, "step": 4})
    assert r1["restored"] == (4, True, {"rank": 1, "step": 4})
    assert r0["kept"] == [4]
    assert r0["after_cutting"] is None and r1["after_cutting"] is None
    assert r0["kept_after_finish"] and r1["kept_after_finish"]
    assert not r0["left"]  # every local rank's clean exit after the finish removes the folder


def _one_job(rank: int, world: int, run: str, value: float) -> Any:
    os.environ["TORCHELASTIC_RUN_ID"] = run
    session = Session()
    session.take(1, {"value": torch.full((3,), value)})
    session._writer.wait()  # type: ignore[union-attr]
    dist.barrier()
    restored = _restart().restore()
    return None if restored is None else float(restored.state["value"][0])


def test_two_jobs_on_one_node_never_mix(tmp_path: Path) -> None:
    env = _env(tmp_path, "unused")
    assert run_ranks(_one_job, 2, "job-a", 1.0, env=env) == [1.0, 1.0]
    assert run_ranks(_one_job, 2, "job-b", 2.0, env=env) == [2.0, 2.0]
    parent = tmp_path / f"bucketddp-{os.geteuid()}"
    assert sorted(p.name for p in parent.iterdir()) == ["job-a", "job-b"]
