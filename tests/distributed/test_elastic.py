"""Elastic training under torchrun with a hand-written loop (real torchrun jobs, real kills).

Rank 1 is killed (SIGKILL) once 16 steps are done (an epoch boundary) and, in another job,
once 11 are done (mid-epoch). torchrun restarts both workers; the loop resumes from the
newest snapshot in shared memory. Each job must exit 0 with the weights of a job that was
never interrupted, bit for bit, having done at most one step twice, written nothing outside
shared memory, and left no snapshot behind. Rank 1 killed after the loop's ``finish()``
(2 restarts allowed): the restart does no step, the job exits 0 with the same weights, and
the workers' clean exits leave nothing. And ten restarts in a row must each form
their process group (the agent's store keeps the last attempt's gloo addresses).

A whole-job preemption (SIGTERM to the torchrun agent, which sends it to every worker and
ends the job) with a disk folder: the same command run again resumes from the disk, with
no step done twice, bit-equal. A disk folder that cannot be made fails every rank before
the first step, naming it.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from elastic_runs import (
    ROOT,
    assert_stopped_together,
    assert_trained_once,
    done_twice,
    same_weights,
    standalone,
    steps_by_attempt,
    torchrun_failing,
)
from lightning_runs import SUPPORT, torchrun

pytestmark = pytest.mark.jobs  # torchrun jobs, killed and restarted

LOOP = SUPPORT / "elastic_loop.py"


def test_a_killed_rank_costs_at_most_one_step_of_a_plain_loop(tmp_path: Path, shm: Path) -> None:
    runs = {"straight": "-1", "epoch_end": "16", "mid_epoch": "11", "sigterm": "13"}
    runs["after_fit"] = "-1"
    for name in runs:
        (tmp_path / name).mkdir()

    def run(name: str) -> str:
        env = {"BUCKETDDP_SNAPSHOT_DIR": str(shm / name)}
        if name == "sigterm":  # a notice: every rank stops after step 14, none done twice
            env.update(ELASTIC_SIGNAL="TERM", ELASTIC_SIGNAL_RANK="1")
        if name == "after_fit":  # rank 1 killed after finish(); attempt 1 is not the last
            env.update(ELASTIC_AFTER_FIT="1")
            return torchrun(LOOP, str(tmp_path / name), runs[name], restarts=2, env=env)
        return torchrun(LOOP, str(tmp_path / name), runs[name], env=env)

    with ThreadPoolExecutor(max_workers=3) as pool:
        outputs = dict(zip(runs, pool.map(run, runs), strict=True))
    assert_stopped_together(tmp_path / "sigterm", outputs["sigterm"], stop=14)
    assert_trained_once(tmp_path / "after_fit", outputs["after_fit"], shm / "after_fit")
    straight = tmp_path / "straight" / "final.pt"
    assert same_weights(tmp_path / "after_fit" / "final.pt", straight)
    for name in ("epoch_end", "mid_epoch", "sigterm"):
        out = tmp_path / name
        assert same_weights(out / "final.pt", tmp_path / "straight" / "final.pt"), name
        for rank in (0, 1):
            assert len(done_twice(out, rank)) <= 1, (name, rank, done_twice(out, rank))
        assert "attempt 1" in (out / "steps.rank1").read_text()  # it did restart
        written = sorted(p.name for p in out.iterdir())
        assert written == ["final.pt", "steps.rank0", "steps.rank1"], written
        left = [p for p in (shm / name).glob("**/*") if not p.is_dir()]
        assert not left, f"snapshots left after a clean finish: {left}"


def test_a_whole_job_preemption_of_a_plain_loop_resumes_from_disk(
    tmp_path: Path, shm: Path
) -> None:
    straight, out, disk = tmp_path / "straight", tmp_path / "out", tmp_path / "disk"
    straight.mkdir()
    out.mkdir()
    torchrun(LOOP, str(straight), "-1", env={"BUCKETDDP_SNAPSHOT_DIR": str(shm / "straight")})
    env = {
        **os.environ,
        "BUCKETDDP_SNAPSHOT_DIR": str(shm / "out"),
        "BUCKETDDP_PREEMPT_DIR": str(disk),
        "ELASTIC_SIGNAL": "AGENT",
    }
    first = subprocess.run(
        [*standalone(1), str(LOOP), str(out), "13"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert first.returncode != 0, (first.stdout + first.stderr)[-3000:]  # the job ended
    assert not [p for p in (shm / "out").glob("**/*") if not p.is_dir()]  # all on disk
    torchrun(LOOP, str(out), "13", env={**env, "ELASTIC_RERUN": "1"})
    for rank in (0, 1):
        # /dev/shm was empty: only the disk held step 14. Both runs are torchrun's
        # attempt 0: steps 1 to 14, then 15 to 24, none twice.
        assert steps_by_attempt(out, rank) == {0: list(range(1, 25))}, rank
    assert same_weights(out / "final.pt", straight / "final.pt")
    assert sorted(p.name for p in disk.iterdir()) == [], "the finished job left its disk copy"


def test_ten_restarts_in_a_row_each_form_their_group(tmp_path: Path) -> None:
    torchrun(SUPPORT / "elastic_restarts.py", str(tmp_path), "10", restarts=10, timeout=300)
    for rank in (0, 1):
        formed = (tmp_path / f"formed.rank{rank}").read_text().split("\n")
        assert [line for line in formed if line] == [f"formed {a}" for a in range(11)]


def _refused(out: Path, folder: Path, width: str = "32") -> str:
    """Run the loop with its snapshots in ``folder`` and no restart: it must fail before
    its first step, on both ranks. Returns its output."""
    env = {"BUCKETDDP_SNAPSHOT_DIR": str(folder), "ELASTIC_WIDTH": width}
    text = torchrun_failing(LOOP, str(out), "-1", env=env)
    assert not list(out.glob("steps.rank*")), "a training step ran"
    for rank in (0, 1):
        assert f"rank {rank} (node 0)" in text, text[-3000:]
    assert "SnapshotFolderError" in text and "BUCKETDDP_SNAPSHOT_DIR" in text, text[-3000:]
    return text


def test_a_bad_snapshot_folder_fails_every_rank_before_the_first_step(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    text = _refused(tmp_path, blocker / "snapshots")  # a folder that cannot be made
    assert "cannot make the snapshot folder" in text, text[-3000:]
    env = {"BUCKETDDP_SNAPSHOT_DIR": str(tmp_path / "shm"), "BUCKETDDP_PREEMPT_DIR": str(blocker)}
    text = torchrun_failing(LOOP, str(tmp_path), "-1", env=env)  # a disk folder that is a file
    assert not list(tmp_path.glob("steps.rank*")), "a training step ran"
    assert f"{blocker} is not a directory" in text and "BUCKETDDP_PREEMPT_DIR" in text, text[-3000:]
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)])
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        # About 180 KiB of parameters, and as much twice for the optimizer: no room for two.
        text = _refused(tmp_path, small, width="4096")
        assert "256.0 KiB free" in text and "two snapshots of this state need about" in text
        assert "--shm-size" in text, text[-3000:]
    finally:
        subprocess.run(["umount", str(small)], check=True)
