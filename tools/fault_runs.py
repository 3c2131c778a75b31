"""Running fault_script.py jobs side by side, and what each rank did: exit, time, output.

Used by the fault tests and by ``benchmarks/fault_matrix.py``. A job runs in a session of
its own; ``hand-written loop`` jobs start one process per rank (as torchrun would),
Lightning jobs start rank 0 and let Lightning's launcher start rank 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from multirank import alive, free_port

SCRIPT = Path(__file__).resolve().parent / "fault_script.py"
WORLD_SIZE = 2


@dataclass
class Job:
    """One fault_script.py run."""

    mode: str
    scenario: str
    out: Path
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    exited_at: dict[int, float] = field(default_factory=dict)  # time.time() per rank
    codes: dict[int, int | None] = field(default_factory=dict)

    @property
    def fault_time(self) -> float | None:
        """When rank 1 faulted (time.time()), or None if it never got there."""
        path = self.out / "fault.json"
        return float(json.loads(path.read_text())["time"]) if path.exists() else None

    def output(self, rank: int = 0) -> str:
        """What rank ``rank`` printed (under Lightning both ranks print to rank 0's file)."""
        path = self.out / f"out{rank if self.mode == 'loop' else 0}.txt"
        return path.read_text(errors="replace")

    def pid(self, rank: int) -> int | None:
        """The pid rank ``rank`` wrote when it started."""
        path = self.out / f"rank{rank}.json"
        return int(json.loads(path.read_text())["pid"]) if path.exists() else None


def start(
    mode: str,
    scenario: str,
    out: Path,
    *,
    stall: float = 600.0,
    system: str = "bucketddp",
    start_method: str = "popen",
) -> Job:
    """Start a job; ``out`` receives its files. ``start_method`` is BucketDDP's."""
    out.mkdir(parents=True, exist_ok=True)
    job = Job(mode, scenario, out)
    cmd = [sys.executable, str(SCRIPT), mode, scenario, str(out), "--stall", str(stall)]
    cmd += ["--system", system, "--start-method", start_method]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = range(WORLD_SIZE) if mode == "loop" else range(1)
    for rank in ranks:
        env_rank = {**env, "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE)}
        if mode == "lightning":
            env_rank = {k: v for k, v in env_rank.items() if k not in ("RANK", "WORLD_SIZE")}
        with open(out / f"out{rank}.txt", "wb") as log:
            job.procs[rank] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env_rank, start_new_session=True
            )
    return job


def wait(jobs: list[Job], timeout: float) -> None:
    """Wait until every rank of every job exited, or ``timeout`` s; then kill what is left.

    Records each rank's exit time and, for processes started here, exit code (a negative
    code is a signal). Lightning's rank 1 is rank 0's child: only its exit time is known.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = False
        for job in jobs:
            for rank in range(WORLD_SIZE):
                if rank in job.exited_at:
                    continue
                proc = job.procs.get(rank)
                if proc is not None:
                    code = proc.poll()
                    if code is None:
                        running = True
                        continue
                    job.codes[rank] = code
                else:
                    pid = job.pid(rank)
                    if pid is None and not job.exited_at.get(0):
                        running = True
                        continue
                    if pid is not None and alive(pid):
                        running = True
                        continue
                job.exited_at[rank] = time.time()
        if not running:
            return
        time.sleep(0.05)
    for job in jobs:
        for proc in job.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for rank in range(WORLD_SIZE):
            pid = job.pid(rank)
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
