"""A training loop under torchrun with ``bucketddp.elastic``, logging when each thing happens.

Run by ``bench_elastic.py --recovery`` and ``--picture``, not by hand::

    torchrun ... benchmarks/elastic_job.py recovery OUT KILL   # the benchmark MLP
    torchrun ... benchmarks/elastic_job.py picture OUT KILL    # a small model that learns

Every rank appends to ``OUT/events.rank<R>.attempt<A>`` one line per milestone, with the
wall-clock time (``time.time()``): ``process`` (when the process was created, from
/proc), ``started`` (the script's first line), ``imported`` (torch and bucketddp),
``group`` (the process group formed), ``data`` (the model and its rows made), ``wrapped``
(``BucketDataParallel``), ``optimizer``, ``built`` (loader and ``Elastic``), ``resumed``
(``Elastic.resume()`` returned) and ``step N WORLD LOSS`` after each completed step (the
loss is the mean over ranks), or ``failed`` when a step raises (a peer died), and
``exited`` as the interpreter ends (after ``sys.excepthook``, when it raised). In attempt
0 the victim logs ``kill`` once ``KILL`` steps are done and then SIGKILLs itself: with
``ELASTIC_VICTIM=rank1``, rank 1; with ``ELASTIC_VICTIM=node`` (given to one agent of
several), that agent's worker, which kills its agent first: the node is lost. Under
``ELASTIC_GROW_AT=N``, a worker alone at world size 1 logs ``waiting`` when N steps are
done and waits for an agent to join (``wait_for_a_joiner``).
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: a restarted worker pays for them too

import atexit  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from bucketddp import BucketDataParallel  # noqa: E402
from bucketddp.elastic import Elastic, ElasticSampler, init_process_group  # noqa: E402
from bucketddp.notice import NOTICE  # noqa: E402
from models import MODELS  # noqa: E402  (this directory's: the benchmark models)

IMPORTED = time.time()

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
BATCH = 32
"""Rows per rank per step."""
RECOVERY_STEPS = 24
"""Steps of the recovery job at world size 2 (one epoch)."""
PICTURE_EPOCHS, PICTURE_ROWS = 3, 4096
"""The picture job: 64 steps an epoch at world size 2, 128 at world size 1."""
GROW_AT = int(os.environ.get("ELASTIC_GROW_AT", "-1"))
"""Under ``ELASTIC_GROW_AT=N``, a worker alone in its round waits in step N + 1 for a
joining agent (``wait_for_a_joiner``)."""


def process_created() -> float:
    """When this process was created (wall clock, 10 ms resolution; Linux), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/self/stat") as f:
        started = int(f.read().rsplit(")", 1)[1].split()[19]) / ticks  # since boot
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)


def recovery_data() -> tuple[torch.nn.Module, TensorDataset]:
    """The benchmark MLP (7.9M parameters) and one epoch of its synthetic rows."""
    spec = MODELS["mlp"]
    x, y = spec.batch(BATCH * 2 * RECOVERY_STEPS, seed=1)
    return spec.build(seed=0), TensorDataset(x, y)


def picture_data() -> tuple[torch.nn.Module, TensorDataset]:
    """A small MLP and rows labelled by a random linear teacher: a loss that goes down."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(PICTURE_ROWS, 32, generator=g)
    y = (x @ torch.randn(32, 8, generator=g)).argmax(dim=1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return net, TensorDataset(x, y)


def wait_for_a_joiner(out: Path) -> None:
    """Say so (``OUT/waiting``), then wait until torchrun's agent, which a new agent has
    joined, sends its stop signal: this step is the last at world size 1 (a hang guard of
    300 s)."""
    (out / "waiting").touch()
    deadline = time.monotonic() + 300
    while not NOTICE.pending:
        if time.monotonic() > deadline:
            raise RuntimeError("no agent joined within 300 s")
        time.sleep(0.05)


def main(mode: str, out: Path, kill: int) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    log = open(out / f"events.rank{rank}.attempt{ATTEMPT}", "a")  # noqa: SIM115

    def event(text: str, at: float | None = None) -> None:
        print(f"{time.time() if at is None else at:.6f} {text}", file=log, flush=True)

    atexit.register(lambda: event("exited"))  # registered first, so it runs last
    event("process", process_created())
    event("started", STARTED)
    event("imported", IMPORTED)
    init_process_group("gloo")
    event("group")
    net, data = recovery_data() if mode == "recovery" else picture_data()
    event("data")
    model = BucketDataParallel(net)
    event("wrapped")
    opt = torch.optim.SGD(model.parameters(), lr=0.02 if mode == "picture" else 0.01, momentum=0.9)
    event("optimizer")
    sampler = ElasticSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, generator=torch.Generator())
    epochs = PICTURE_EPOCHS if mode == "picture" else 1
    state = {"model": model, "optimizer": opt, "epoch": 0}
    job = Elastic(state, sampler=sampler, batch_size=BATCH)
    event("built")
    job.resume()
    event("resumed")
    victim = os.environ.get("ELASTIC_VICTIM")
    doomed = ATTEMPT == 0 and (victim == "node" or (victim == "rank1" and rank == 1))
    try:
        while state["epoch"] < epochs:
            sampler.set_epoch(state["epoch"])
            for x, y in loader:
                if dist.get_world_size() == 1 and job.steps == GROW_AT:
                    event("waiting")
                    wait_for_a_joiner(out)
                if doomed and job.steps == kill:
                    event("kill")
                    if victim == "node":
                        os.kill(os.getppid(), signal.SIGKILL)  # this node's agent, then this
                    os.kill(os.getpid(), signal.SIGKILL)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                job.step()
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                world = dist.get_world_size()
                event(f"step {job.steps} {world} {mean.item() / world:.6f}")
            state["epoch"] += 1
    except Exception:
        event("failed")  # a peer died: this worker's own end, before torchrun restarts it
        raise
    job.finish()
    event("finished")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
