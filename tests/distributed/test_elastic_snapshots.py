"""Snapshots on real process groups: what is kept, what is refused, and that jobs never mix.

The ranks run under ``run_ranks`` with the variables torchrun would set (run id, attempt,
node, local ranks) and a snapshot folder of the test's own. A "restart" is a new Session
with a higher attempt number, in the same processes: what it reads is only what the files
hold.
"""

from __future__ import annotations

import contextlib
import io
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


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _bn_snapshots(rank: int, world: int, policy: str) -> dict[str, Any]:
    """Three steps of a BatchNorm net with a snapshot after each, the collectives each
    snapshot made profiled; then a restart in the same processes resumes from the last."""
    from torch.profiler import ProfilerActivity, profile

    from bucketddp import BucketDataParallel
    from bucketddp.elastic import Elastic

    def build(seed: int) -> tuple[BucketDataParallel, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
        model = BucketDataParallel(net, buffer_sync={"*running_*": policy})
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    os.environ["LOCAL_RANK"] = str(rank)
    model, opt = build(0)
    job = Elastic({"model": model, "optimizer": opt})
    job.resume()
    out: dict[str, Any] = {"made": []}
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            job.step()
        out["made"].append([e.name for e in prof.events() if e.name.startswith("c10d::")])
    out["at_snapshot"] = _buffers(model.module)
    job.session._writer.wait()  # type: ignore[union-attr]
    dist.barrier()
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    again, opt2 = build(1)
    resumed = Elastic({"model": again, "optimizer": opt2})
    out["resumed"] = resumed.resume()
    out["restored"] = _buffers(again.module)
    out["same_weights"] = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )
    return out


def test_a_snapshot_makes_no_collective_and_each_rank_gets_its_own_buffers(
    tmp_path: Path,
) -> None:
    # BatchNorm's default, "broadcast": rank 0 already holds what a sync would give, so a
    # snapshot syncs nothing; each rank's own statistics (which differ until the next
    # forward's broadcast) come back to it at an unchanged world size.
    r0, r1 = run_ranks(_bn_snapshots, 2, "broadcast", env=_env(tmp_path, "bn-broadcast"))
    for r in (r0, r1):
        assert r["made"] == [[], [], []]
        assert r["resumed"] and r["same_weights"]
    assert not torch.equal(r0["at_snapshot"]["1.running_mean"], r1["at_snapshot"]["1.running_mean"])
    for r in (r0, r1):
        for name, value in r["at_snapshot"].items():
            assert torch.equal(r["restored"][name], value), name
    # A policy that combines the ranks' values ("mean" here, for the statistics) makes the
    # snapshot sync every buffer, as a checkpoint has them: the mean's all-reduce and the
    # count's broadcast; every rank restores the synced values.
    r0, r1 = run_ranks(_bn_snapshots, 2, "mean", env=_env(tmp_path, "bn-mean"))
    for r in (r0, r1):
        assert [sorted(made) for made in r["made"]] == [
            ["c10d::allreduce_", "c10d::broadcast_"]
        ] * 3
        assert r["resumed"] and r["same_weights"]
    for name, value in r0["at_snapshot"].items():
        assert torch.equal(value, r1["at_snapshot"][name]), name
        assert torch.equal(r0["restored"][name], value) and torch.equal(r1["restored"][name], value)


def _restarted_node_finds_nothing(rank: int, world: int) -> tuple[bool, str]:
    # Two nodes of one worker each: rank 0's joined this round (attempt 0), rank 1's was
    # restarted (attempt 1); no node kept a snapshot.
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0", TORCHELASTIC_RESTART_COUNT=str(rank))
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        restored = Session().restore()
    return restored is None, said.getvalue()


def test_a_restart_that_finds_no_snapshot_says_so_when_rank_0_is_a_new_node(
    tmp_path: Path,
) -> None:
    env = {**_env(tmp_path, "joined"), "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "2"}
    (none0, said0), (none1, said1) = run_ranks(_restarted_node_finds_nothing, 2, env=env)
    assert none0 and none1
    assert "attempt 1 of this job found no usable snapshot on any node" in said0
    assert said1 == ""
