"""A hand-written loop under torchrun with ``bucketddp.elastic``: run by test_elastic.py.

Three epochs of 8 steps on 2 ranks (a shuffled ElasticSampler), a net with BatchNorm. In
attempt 0, rank 1 kills itself (SIGKILL; SIGSTOP under ``ELASTIC_KILL=STOP``) when ``kill``
steps are done; torchrun restarts both workers and the loop resumes from the newest snapshot. Under
``ELASTIC_SIGNAL=TERM``, rank ``ELASTIC_SIGNAL_RANK`` sends itself SIGTERM then instead
(``notice_due``). Each rank logs every step it completes (and the attempt) to
``<out>/steps.rank<R>``; rank 0 saves the final weights to ``<out>/final.pt``. Under
``ELASTIC_AFTER_FIT=1``, each rank logs each return from the loop to ``<out>/fits.rank<R>``,
and in attempt 0 rank 1 kills itself (SIGKILL) once rank 0 has saved the weights
(``after_fit``). Under
``ELASTIC_PLANT=1`` the job runs with umask 0, and rank 0 plants files in its snapshot
folder and records its modes (``elastic_planted.py``). Under ``ELASTIC_AUGMENT=1`` the
rows get noise drawn in ``__getitem__`` from torch's and Python's global generators
(``Augmented``), as a random augmentation in a main-process loader does.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import elastic_planted
from bucketddp import BucketDataParallel
from bucketddp.elastic import Elastic, ElasticSampler, init_process_group

EPOCHS, BATCH = 3, 4
# How rank 1 is stopped in attempt 0: SIGKILL, or under ELASTIC_KILL=STOP, SIGSTOP (a rank
# that hangs without closing its connections, as a host that lost power does).
KILL = signal.SIGSTOP if os.environ.get("ELASTIC_KILL") == "STOP" else signal.SIGKILL
AUGMENT = os.environ.get("ELASTIC_AUGMENT") == "1"
if AUGMENT:
    random.seed(0)  # once per process, as a script's seed_everything would


class Augmented(TensorDataset):
    """Rows with noise drawn in ``__getitem__`` from the global generators (torch's and
    Python's), as a random augmentation in the main process draws."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        x, y = super().__getitem__(index)
        return x + 0.1 * torch.randn(x.shape) * random.random(), y


def dataset() -> TensorDataset:
    """64 rows: 8 steps an epoch on 2 ranks; augmented under ``ELASTIC_AUGMENT=1``."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)
    return Augmented(*rows) if AUGMENT else TensorDataset(*rows)


def attempt_of_job() -> int:
    """This process's attempt: torchrun's restart count, or SLURM's requeue count."""
    env = os.environ
    return int(env.get("TORCHELASTIC_RESTART_COUNT", env.get("SLURM_RESTART_COUNT", "0")))


def notice_due(rank: int, done: int, kill: int) -> bool:
    """Whether a stop notice, not a kill, ends attempt 0 (``ELASTIC_SIGNAL`` set); if so,
    at the step ``kill`` it is sent, in the job's first run (``ELASTIC_RERUN`` unset):

    - ``TERM``: rank ``ELASTIC_SIGNAL_RANK`` sends itself SIGTERM;
    - ``AGENT``: rank 0 sends SIGTERM to its torchrun agent, which sends it to every
      worker and ends the job (a whole-job preemption), and waits for its own;
    - ``USR1``: every rank sends itself SIGUSR1 (SLURM's ``--signal=USR1@...``).
    """
    how = os.environ.get("ELASTIC_SIGNAL")
    if how is None:
        return False
    if attempt_of_job() != 0 or os.environ.get("ELASTIC_RERUN") == "1" or done != kill:
        return True
    if how == "TERM" and rank == int(os.environ.get("ELASTIC_SIGNAL_RANK", "1")):
        os.kill(os.getpid(), signal.SIGTERM)  # handled: training goes on to the stop
    elif how == "AGENT" and rank == 0:
        from bucketddp.notice import NOTICE

        os.kill(os.getppid(), signal.SIGTERM)
        deadline = time.monotonic() + 120  # a hang guard: the agent sends it at once
        while not NOTICE.pending and time.monotonic() < deadline:
            time.sleep(0.01)
    elif how == "USR1":
        os.kill(os.getpid(), signal.SIGUSR1)
    return True


def after_fit(out: str, rank: int, attempt: int, steps: int) -> None:
    """Under ``ELASTIC_AFTER_FIT=1``: log that the fit returned, after ``steps`` steps; in
    attempt 0, rank 0 says it saved the final weights, and rank 1 waits for that, then
    SIGKILLs itself: torchrun restarts both workers, though the fit had finished."""
    if os.environ.get("ELASTIC_AFTER_FIT") != "1":
        return
    with open(f"{out}/fits.rank{rank}", "a") as log:
        print(f"fit returned attempt {attempt} steps {steps}", file=log)
    if attempt != 0:
        return
    if rank == 0:
        open(f"{out}/saved", "w").close()
    elif rank == 1:
        deadline = time.monotonic() + 120
        while not os.path.exists(f"{out}/saved") and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)


def main(out: str, kill: int) -> None:
    torch.set_num_threads(1)
    plant = os.environ.get("ELASTIC_PLANT") == "1"
    if plant:
        os.umask(0)
    init_process_group("gloo")
    rank, attempt = dist.get_rank(), attempt_of_job()
    torch.manual_seed(0)
    width = int(os.environ.get("ELASTIC_WIDTH", "32"))
    # BatchNorm's statistics are "broadcast" buffers: a snapshot takes each rank's own.
    net = torch.nn.Sequential(
        torch.nn.Linear(8, width),
        torch.nn.BatchNorm1d(width),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(width, 2),
    )
    model = BucketDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = dataset()
    sampler = ElasticSampler(data, shuffle=True, seed=0)
    # A generator of its own: a new iterator then draws its seed from it, not from torch's
    # global one, whose stream (dropout here) goes on exactly after a resume.
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, generator=torch.Generator())
    state = {"model": model, "optimizer": opt, "epoch": 0}
    job = Elastic(state, sampler=sampler, batch_size=BATCH)
    job.resume()
    with open(f"{out}/steps.rank{rank}", "a") as log:
        while state["epoch"] < EPOCHS:
            sampler.set_epoch(state["epoch"])
            for x, y in loader:
                if notice_due(rank, job.steps, kill):
                    pass
                elif attempt == 0 and rank == 1 and job.steps == kill:
                    os.kill(os.getpid(), KILL)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                print(f"step {job.steps + 1} attempt {attempt}", file=log, flush=True)
                job.step()
                if plant and rank == 0:
                    elastic_planted.after_step(job, out, attempt)
            state["epoch"] += 1
    job.finish()
    if rank == 0:
        torch.save(net.state_dict(), f"{out}/final.pt")
    after_fit(out, rank, attempt, job.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
