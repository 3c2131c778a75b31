"""Where a process is in an elastic job, as SLURM's variables say it (no torchrun)."""

from __future__ import annotations

import pytest

from bucketddp.elastic.disk import preempt_dir
from bucketddp.elastic.job import Job, under_slurm

SRUN = {
    "SLURM_JOB_ID": "77",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "7",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "3",
    "SLURM_TASKS_PER_NODE": "2(x3),1",
}


@pytest.fixture
def srun(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in SRUN.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


def test_a_slurm_task_knows_its_place(srun: pytest.MonkeyPatch) -> None:
    assert under_slurm()
    job = Job.from_env()
    assert (job.run_id, job.attempt, job.node, job.rank, job.world_size) == ("slurm-77", 0, 3, 5, 7)
    assert (job.local_rank, job.local_world_size) == (1, 1)  # node 3 is the fourth: 1 task
    assert job.slurm and job.last_attempt  # nothing restarts it in place
    srun.setenv("SLURM_NODEID", "1")
    srun.setenv("SLURM_RESTART_COUNT", "2")
    srun.setenv("SLURM_ARRAY_JOB_ID", "70")
    srun.setenv("SLURM_ARRAY_TASK_ID", "4")
    job = Job.from_env()
    assert (job.run_id, job.attempt, job.local_world_size) == ("slurm-70_4", 2, 2)


def test_torchrun_inside_slurm_is_torchrun(srun: pytest.MonkeyPatch) -> None:
    srun.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    srun.setenv("TORCHELASTIC_RUN_ID", "r")
    assert not under_slurm()


def test_the_disk_folder_comes_from_the_option_else_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BUCKETDDP_PREEMPT_DIR", raising=False)
    assert preempt_dir(None) is None
    monkeypatch.setenv("BUCKETDDP_PREEMPT_DIR", "/ckpt/run")
    assert str(preempt_dir(None)) == "/ckpt/run"
    assert str(preempt_dir("/other")) == "/other"
