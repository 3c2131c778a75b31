"""A job that ends for good leaves no snapshot behind (real torchrun jobs, real kills).

With ``--max-restarts=0``, rank 1 of the plain loop is stopped once 5 steps are done (each
step took a snapshot); torchrun will not restart, and each job must exit non-zero with
nothing left under its snapshot root, not even the per-user folder:

- rank 1 SIGKILLed: rank 0's collective fails (and its agent sends it SIGTERM, which only
  sets the stop flag); it raises, and removes the node's folder on its way out;
- rank 1 SIGSTOPped (a rank that hangs with its connections open, as a host that lost
  power): rank 0 waits in the all-reduce, the watchdog names the silent rank, and ends
  rank 0's main thread, stuck in C++, with ``os._exit``; the folder goes first.

That a job with a restart left still resumes from its snapshots is test_elastic.py's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from elastic_runs import steps_by_attempt, torchrun_failing
from lightning_runs import SUPPORT

pytestmark = pytest.mark.jobs  # torchrun jobs killed on their last attempt

LOOP = SUPPORT / "elastic_loop.py"


def test_a_job_killed_on_its_last_attempt_leaves_no_snapshot(tmp_path: Path, shm: Path) -> None:
    kinds = ("KILL", "STOP")

    def run(kind: str) -> str:
        (tmp_path / kind).mkdir()
        env = {"BUCKETDDP_SNAPSHOT_DIR": str(shm / kind), "ELASTIC_KILL": kind}
        return torchrun_failing(LOOP, str(tmp_path / kind), "5", env=env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        outputs = dict(zip(kinds, pool.map(run, kinds), strict=True))
    for kind, text in outputs.items():
        # Both ranks did steps 1..5 (a snapshot after each) and no other: rank 1 stopped
        # before step 6, and rank 0 could not finish step 6 without it.
        for rank in (0, 1):
            assert steps_by_attempt(tmp_path / kind, rank) == {0: [1, 2, 3, 4, 5]}, text[-3000:]
        assert "rank 0 removed this node's snapshots" in text, (kind, text[-3000:])
        left = sorted(str(p) for p in (shm / kind).glob("**/*"))
        assert not left, f"left behind by a job that ended for good: {left}"
    assert "stops because rank 1" in outputs["KILL"], outputs["KILL"][-3000:]
    # The SIGSTOP job's rank 0 took the forced exit, which skips atexit.
    assert "did not take the error within" in outputs["STOP"], outputs["STOP"][-3000:]
