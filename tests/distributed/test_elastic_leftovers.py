"""A job that ends for good leaves no snapshot behind (a real torchrun job, a real kill).

With ``--max-restarts=0``, rank 1 of the plain loop is SIGKILLed once 5 steps are done
(each step took a snapshot). torchrun will not restart: the job exits non-zero, and rank 0,
whose collective fails and whose agent sends it SIGTERM, removes the node's snapshot
folder on its way out. Nothing is left under the snapshot root, not even the per-user
parent. (That a job with a restart left still resumes from its snapshots is
test_elastic.py's.)
"""

from __future__ import annotations

from pathlib import Path

from elastic_runs import steps_by_attempt, torchrun_failing
from lightning_runs import SUPPORT

LOOP = SUPPORT / "elastic_loop.py"


def test_a_job_killed_on_its_last_attempt_leaves_no_snapshot(tmp_path: Path, shm: Path) -> None:
    text = torchrun_failing(LOOP, str(tmp_path), "5", env={"BUCKETDDP_SNAPSHOT_DIR": str(shm)})
    # Both ranks did steps 1..5 (a snapshot after each) and no other: rank 1 died before
    # step 6, and rank 0 could not finish step 6 without it.
    for rank in (0, 1):
        assert steps_by_attempt(tmp_path, rank) == {0: [1, 2, 3, 4, 5]}, text[-3000:]
    assert "rank 0 removed this node's snapshots" in text, text[-3000:]
    left = sorted(str(p) for p in shm.glob("**/*")) if shm.exists() else []
    assert not left, f"left behind by a job that ended for good: {left}"
