"""SLURM's requeue after a stop: the job goes back in the queue, and resumes from disk.

SLURM warns a job before it takes its nodes: ``#SBATCH --signal=USR1@90`` sends SIGUSR1 to
every task 90 s before the end. Lightning's ``SLURMEnvironment(auto_requeue=True)`` (the
default) answers it, on rank 0, with ``scontrol requeue <job id>`` after saving a
checkpoint. Under ``BucketDDP(elastic=True)`` the signal is a stop notice instead
(``notice.py``): every rank stops after the same step, the snapshot of that step goes to
the disk folder (``disk.py``), and only then does rank 0 requeue the job, here. The
requeued job, with the same job id, resumes from the disk: no step is done twice.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

from .job import slurm_job_id


def requeue() -> None:
    """``scontrol requeue`` this SLURM job, saying on stderr how it went."""
    job = slurm_job_id()
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        print(f"bucketddp: cannot requeue SLURM job {job}: no scontrol on PATH", file=sys.stderr)
        return
    done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True)
    if done.returncode == 0:
        print(f"bucketddp: requeued SLURM job {job}", file=sys.stderr, flush=True)
    else:
        print(
            f"bucketddp: scontrol requeue {job} failed ({done.returncode}): "
            f"{(done.stderr or done.stdout).strip()}",
            file=sys.stderr,
            flush=True,
        )
