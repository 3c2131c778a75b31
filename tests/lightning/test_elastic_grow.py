"""BucketDDP(elastic=True) when a node joins a running torchrun job (``--nnodes=1:2``).

torchrun's agents on this machine, one worker each, with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(without it torchrun's own scale-up deadlocks: ``dev.py scaleup-repro``). A Trainer fit of
3 epochs of 64 rows whose ``"sum"`` buffer counts the rows it trains on:

- one agent starts alone; when its worker has done 10 steps, a second agent joins. The first
  agent stops its worker (SIGTERM: the worker stops after step 11 with a snapshot of it),
  and both workers start at world size 2; the new one receives the state over the group.
  The job finishes at world size 2, every epoch uses every row exactly once, the ``"sum"``
  buffer counts 192 rows on each rank, nothing is written outside the test's logs, and the
  node's snapshots are gone at the end;
- two agents start; one is lost (its worker kills it, and itself, after 6 steps); the other
  goes on at world size 1, and at step 14 a third agent joins: the same checks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from elastic_runs import agent, rows_by_epoch, start
from lightning_runs import SUPPORT
from multirank import free_port

pytestmark = pytest.mark.jobs  # torchrun agents joining a running job

pytest.importorskip("lightning")

SCRIPT = SUPPORT / "elastic_lightning.py"
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _agent(out: Path, port: int, name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [*agent(port, host=name == "A"), str(SCRIPT), "nodes", str(out), "6"]
    return start(cmd, out / f"agent{name}.log", {**NO_SHARED_STORE, **env})


def _wait_for(path: Path, agents: list[subprocess.Popen[bytes]], out: Path) -> None:
    """Wait until ``path`` exists (a hang guard of 180 s), failing if an agent ends first."""
    deadline = time.monotonic() + 180
    while not path.exists():
        ended = [a for a in agents if a.poll() is not None]
        assert not ended and time.monotonic() < deadline, _logs(out)
        time.sleep(0.1)


def _logs(out: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("agent*.log")))


def _check_run(out: Path, shm: Path) -> None:
    for rank in (0, 1):
        assert (out / f"done.rank{rank}").read_text().split() == ["world", "2", "seen", "192"]
    rows = rows_by_epoch(out)
    assert sorted(rows) == [0, 1, 2]
    for epoch, count in rows.items():
        assert count == Counter(range(64)), f"epoch {epoch}: rows lost or used twice"
    text = _logs(out)
    assert "every rank stops after step" in text, text  # the grow stop took a snapshot
    assert "resuming from this job's snapshot" in text, text
    written = {p.name.split(".")[0] for p in out.iterdir()}
    assert written <= {"agentA", "agentB", "agentC", "rows", "done", "waiting"}, written
    assert not list(shm.glob("**/*.meta")), "snapshots left behind"


def _end(agents: list[subprocess.Popen[bytes]]) -> None:
    for proc in agents:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.timeout(600)  # a hang guard: two torchrun agents of Lightning
def test_a_node_that_joins_trains_on_at_the_larger_size(tmp_path: Path, shm: Path) -> None:
    port = free_port()
    env = {"BUCKETDDP_SNAPSHOT_DIR": str(shm), "ELASTIC_GROW_AT": "10"}
    agents = [_agent(tmp_path, port, "A", env)]
    try:
        _wait_for(tmp_path / "waiting", agents, tmp_path)  # alone, at step 11
        agents.append(_agent(tmp_path, port, "B", env))
        for proc in agents:
            assert proc.wait(timeout=240) == 0, _logs(tmp_path)
    finally:
        _end(agents)
    _check_run(tmp_path, shm)
    assert "every rank stops after step 11" in _logs(tmp_path)


@pytest.mark.timeout(600)  # a hang guard: three torchrun agents of Lightning
def test_a_job_that_lost_a_node_grows_back(tmp_path: Path, shm: Path) -> None:
    port = free_port()
    env = {"BUCKETDDP_SNAPSHOT_DIR": str(shm)}
    agents = [
        _agent(tmp_path, port, "A", {**env, "ELASTIC_GROW_AT": "14"}),
        _agent(tmp_path, port, "B", {**env, "ELASTIC_VICTIM": "1"}),
    ]
    try:
        _wait_for(tmp_path / "waiting", agents[:1], tmp_path)  # B lost, A alone at step 15
        assert agents[1].wait(timeout=30) == -signal.SIGKILL
        agents.append(_agent(tmp_path, port, "C", env))
        for proc in (agents[0], agents[2]):
            assert proc.wait(timeout=240) == 0, _logs(tmp_path)
    finally:
        _end(agents)
    _check_run(tmp_path, shm)
    assert "every rank stops after step 15" in _logs(tmp_path)
