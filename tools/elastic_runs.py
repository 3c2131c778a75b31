"""Running torchrun jobs for the elastic tests (and bench_elastic.py's commands), and
reading what they logged.

Nothing here imports Lightning, or pytest: a test runs a job that must succeed through
``torchrun`` in tests/support/lightning_runs.py, which fails the test on a timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: the jobs' working directory."""


def standalone(restarts: int, run_id: str | None = None) -> list[str]:
    """torchrun's command up to the script: one agent, 2 workers, ``restarts`` restarts;
    the run id ``run_id`` if given (else a random one, as ``--standalone`` draws)."""
    one_node = ["--standalone"]
    if run_id is not None:
        one_node = [
            "--nnodes=1",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0",
            f"--rdzv-id={run_id}",
        ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *one_node,
        "--nproc-per-node=2",
        f"--max-restarts={restarts}",
        "--monitor-interval=0.1",
    ]


def agent(port: int, *, host: bool, conf: str = "") -> list[str]:
    """torchrun's command up to the script for one of two agents of one worker each on this
    machine (``--nnodes=1:2``, a c10d rendezvous on ``port``, which the ``host`` agent
    serves; one restart). ``conf`` adds rendezvous options (``,key=value...``).

    ``last_call_timeout=10``: the first round waits that long for the second agent once the
    first has joined. Both import torch at once, and on a busy machine one may join seconds
    after the other; a round formed without it would leave it to join a running job (which
    deadlocks torchrun's rendezvous). The survivor's round after a loss waits as long."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=job{port}",
        f"--rdzv-conf=is_host={int(host)},last_call_timeout=10{conf}",
        "--max-restarts=1",
        "--monitor-interval=0.1",
    ]


def start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in the repository root, in a session of its own (so that the job can
    be ended whole), with ``env`` added and its output to ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **env},
            start_new_session=True,
        )


def torchrun_failing(script: Path, *args: str, env: dict[str, str]) -> str:
    """Run ``script`` on 2 local workers under torchrun with no restart and ``env`` added;
    asserts that the job exits non-zero. Returns its output."""
    run = subprocess.run(
        [*standalone(0), str(script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, **env},
    )
    text = run.stdout + run.stderr
    assert run.returncode != 0, text[-3000:]
    return text


def done_twice(out: Path, rank: int) -> list[int]:
    """The steps rank ``rank`` completed in more than one attempt (from its step log)."""
    steps = Counter(
        int(line.split()[1])
        for line in (out / f"steps.rank{rank}").read_text().splitlines()
        if line.startswith("step ")
    )
    return sorted(s for s, n in steps.items() if n > 1)


def rows_by_epoch(out: Path) -> dict[int, Counter[int]]:
    """The rows each epoch trained on, from the row logs of every worker process of a job
    (``OUT/rows.rank<R>.pid<P>``: a line per step, ``global_step epoch rows...``). A process
    resumed at the step of its first line; a step an earlier process did at or after that
    point was redone, or lost with it, and is not counted."""
    logs = [(p, p.read_text().splitlines()) for p in out.glob("rows.rank*.pid*")]
    starts = sorted({int(lines[0].split()[0]) for _, lines in logs if lines})
    counted: dict[int, Counter[int]] = {}
    for _, lines in logs:
        if not lines:
            continue
        start = int(lines[0].split()[0])
        later = [s for s in starts if s > start]
        for line in lines:
            step, epoch, *indices = map(int, line.split())
            if not later or step < later[0]:
                counted.setdefault(epoch, Counter()).update(indices)
    return counted


def same_weights(a: Path, b: Path) -> bool:
    """Whether two saved state dicts are bit-equal."""
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def steps_by_attempt(out: Path, rank: int) -> dict[int, list[int]]:
    """The steps rank ``rank`` completed in each attempt, in order (from its step log)."""
    found: dict[int, list[int]] = {}
    for line in (out / f"steps.rank{rank}").read_text().splitlines():
        if line.startswith("step "):
            _, step, _, attempt = line.split()
            found.setdefault(int(attempt), []).append(int(step))
    return found


def assert_stopped_together(out: Path, output: str, stop: int, total: int = 24) -> None:
    """After a stop signal in attempt 0: every rank did steps 1..``stop`` in attempt 0 and
    ``stop``+1..``total`` in attempt 1 (none twice, none lost), and said where it stopped."""
    for rank in (0, 1):
        steps = steps_by_attempt(out, rank)
        assert steps == {0: list(range(1, stop + 1)), 1: list(range(stop + 1, total + 1))}, (
            rank,
            steps,
        )
    assert f"every rank stops after step {stop}," in output, output[-4000:]
    assert "stall_timeout" not in output, output[-4000:]


def assert_trained_once(out: Path, output: str, root: Path, total: int = 24) -> None:
    """After rank 1 was SIGKILLed in attempt 0 once the fit had returned (``ELASTIC_AFTER_FIT``):
    every rank did steps 1..``total`` in attempt 0 and none in attempt 1, whose fit returned
    at once at step ``total``; the node's last clean exit removed everything under ``root``."""
    for rank in (0, 1):
        assert steps_by_attempt(out, rank) == {0: list(range(1, total + 1))}, (rank, output[-3000:])
        fits = (out / f"fits.rank{rank}").read_text().splitlines()
        assert fits == [f"fit returned attempt {a} steps {total}" for a in (0, 1)], (rank, fits)
    cleaned = "removed this node's snapshots: every worker of the node exited cleanly"
    assert cleaned in output, output[-3000:]
    left = sorted(str(p) for p in root.glob("**/*"))
    assert not left, f"left behind by a job that ended: {left}"
