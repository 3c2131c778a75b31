"""BucketDDP(elastic=True) and BucketFabricDDP(elastic=True) under torchrun: real jobs, real kills.

- A Trainer fit of 24 steps (8 an epoch) on 2 workers, rank 1 SIGKILLed once 16 steps are
  done (an epoch boundary, plain DataLoader) and once 11 are (mid-epoch, a plain DataLoader
  and a StatefulDataLoader), and the same loop under Fabric: each job exits 0 with the
  weights of the fit that was never interrupted, bit for bit (dropout included), having
  done at most one step twice,
  written no file but the test's own, and left no snapshot behind.
- SIGTERM (a preemption notice) to rank 1, or rank 0, of a Trainer fit, or to rank 1 of
  the Fabric loop, once 13 steps are done: every rank stops after step 14 with a snapshot
  of it, torchrun restarts them, and the job exits 0, bit-equal, with no step done twice
  (and without waiting for ``stall_timeout``: Lightning's own handler never runs).
- With ``accumulate_grad_batches=2``, rank 1 SIGKILLed in the second batch of the first
  step: bit-equal to the same fit uninterrupted (no snapshot of a half-accumulated step).
- Validating every 4 steps, rank 1 SIGKILLed in the validation run after step 12: step 12
  is done again, with its validation, and the weights are bit-equal; SIGTERM to rank 1 in
  step 12: every rank stops after that validation run, and nothing is done twice.
- With PowerSGD, rank 1 SIGKILLed after 13 steps of the Trainer fit and the Fabric loop:
  bit-equal to the same run uninterrupted (the hook's state is in the snapshots).
- With PowerSGD, a Trainer checkpoint saved after step 16 and resumed by a new fit with
  ``ckpt_path``: bit-equal to the fit that went on.
- Rank 1 SIGKILLed after ``fit()`` returned (the Trainer's, and the Fabric loop's
  ``finish()``), with 2 restarts allowed: the restart does no training step, its fit returns
  at once with the final state (bit-equal), the job exits 0, and the node's workers'
  clean exits leave nothing under the snapshot root.
- A node lost: two torchrun agents on this machine (``--nnodes=1:2``), one killed with its
  worker mid-epoch; the other goes on at world size 1, every epoch uses every row exactly
  once, and a ``"sum"`` buffer counts every row once. With a ``WeightedRandomSampler``
  instead (Lightning wraps it), the survivor finishes and warns once that the epoch's rows
  may be used twice or not at all. With two training loaders (``max_size_cycle`` and
  ``min_size``), each loader's rows are used once per pass and the epoch ends where the
  loader that ends it runs out.
- A whole-job preemption: SIGTERM to the torchrun agent once 13 steps are done (it sends
  SIGTERM to every worker and ends the job), with ``BUCKETDDP_PREEMPT_DIR`` given: every
  rank stops after step 14, the snapshot goes to disk and ``/dev/shm`` is left empty; the
  same command run again resumes from the disk: steps 15 to 24, bit-equal, and the disk
  copy is gone once the fit is done.
- SLURM's auto-requeue: two ranks started as ``srun`` would (SLURM's variables, no
  torchrun), ``scontrol`` faked on ``PATH``; SIGUSR1 to every rank once 13 steps are done:
  they stop after step 14, the snapshot goes to the default disk folder in
  ``default_root_dir``, rank 0 requeues the job (once); the requeued run
  (``SLURM_RESTART_COUNT=1``) resumes from it: steps 15 to 24, bit-equal.
- Without torchrun, ``elastic=True`` says it takes no snapshots.

The loaders' own cases (samplers of the user's, worker processes, augmentations, epoch
ends, Fabric's loaders) are in test_elastic_loaders.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from elastic_runs import (
    ROOT,
    agent,
    assert_stopped_together,
    assert_trained_once,
    done_twice,
    rows_by_epoch,
    same_weights,
    standalone,
    start,
)
from elastic_trainer_runs import SCRIPT, lightning_before, run_and_compare
from lightning_runs import torchrun
from multirank import free_port

pytestmark = pytest.mark.jobs  # torchrun jobs, killed and restarted

pytest.importorskip("lightning")


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The uninterrupted Trainer fit and Fabric loop, run once for the module's tests:
    ``<path>/trainer`` and ``<path>/fabric`` hold their ``final.pt``."""
    top = tmp_path_factory.mktemp("straight")
    snapshots = Path("/dev/shm") / f"bucketddp-test-{uuid.uuid4().hex[:8]}"
    try:
        run_and_compare(top, snapshots, {"trainer": ("trainer", "-1"), "fabric": ("fabric", "-1")})
        yield top
    finally:
        shutil.rmtree(snapshots, ignore_errors=True)


@pytest.mark.timeout(900)  # a hang guard: several torchrun jobs of Lightning
def test_a_killed_rank_costs_at_most_one_step(tmp_path: Path, shm: Path, straight: Path) -> None:
    runs = {
        "trainer/epoch_end": ("trainer", "16"),
        "trainer/mid_epoch": ("trainer", "11"),
        "stateful/mid_epoch": ("stateful", "11"),
        "fabric/epoch_end": ("fabric", "16"),
        "fabric/mid_epoch": ("fabric", "11"),
    }
    run_and_compare(tmp_path, shm, runs, straight)


@pytest.mark.timeout(900)  # a hang guard: several torchrun jobs of Lightning
def test_a_stop_signal_costs_no_step(tmp_path: Path, shm: Path, straight: Path) -> None:
    runs = {
        "trainer/sigterm1": ("trainer", "13"),
        "trainer/sigterm0": ("trainer", "13"),
        "fabric/sigterm1": ("fabric", "13"),
    }
    run_and_compare(tmp_path, shm, runs, straight)


@pytest.mark.timeout(900)  # a hang guard: several torchrun jobs of Lightning
def test_a_comm_hooks_state_survives_a_kill(tmp_path: Path, shm: Path) -> None:
    """PowerSGD (rank 1, from step 2), rank 1 SIGKILLed once 13 steps are done: the error
    feedback, memories and generator come back, and the weights are bit-equal."""
    runs = {
        "trainer/straight": ("trainer", "-1"),
        "trainer/killed": ("trainer", "13"),
        "fabric/straight": ("fabric", "-1"),
        "fabric/killed": ("fabric", "13"),
    }
    run_and_compare(tmp_path, shm, runs, env={"ELASTIC_POWERSGD": "1"})
    for family in ("trainer", "fabric"):
        out = tmp_path / family / "killed"
        assert "attempt 1" in (out / "steps.rank1").read_text(), f"{family} did not restart"
        for rank in (0, 1):
            assert len(done_twice(out, rank)) <= 1, (family, rank, done_twice(out, rank))
        reference = tmp_path / family / "straight" / "final.pt"
        assert same_weights(out / "final.pt", reference), family


@pytest.mark.timeout(600)  # a hang guard: two torchrun jobs of Lightning
def test_a_rank_killed_while_accumulating_resumes_bit_equal(tmp_path: Path, shm: Path) -> None:
    """``accumulate_grad_batches=2``: rank 1 SIGKILLed in the second batch of the first
    step, after the first batch's backward, whose gradients no snapshot holds: the restart
    starts that step over, and the weights are bit-equal to the fit uninterrupted."""
    runs = {"accumulate/straight": ("accumulate", "-1"), "accumulate/killed": ("accumulate", "0")}
    run_and_compare(tmp_path, shm, runs)
    out = tmp_path / "accumulate"
    assert "attempt 1" in (out / "killed" / "steps.rank1").read_text(), "it did not restart"
    assert same_weights(out / "killed" / "final.pt", out / "straight" / "final.pt")


@pytest.mark.compat("elastic")  # CI runs it with Lightning 2.4 and 2.5 too (compat --pinned)
@pytest.mark.timeout(600)  # a hang guard: three torchrun jobs of Lightning
def test_a_rank_killed_in_a_validation_run_resumes_bit_equal(tmp_path: Path, shm: Path) -> None:
    """Validation every 4 steps, mid-epoch; rank 1 SIGKILLed in the run after step 12. That
    run draws from the random generators (its DataLoader's seed) and a resumed fit does not
    run it again, so step 12's snapshot waits for its end: the restart goes back to step
    11's, does step 12 and its validation again, and ends bit-equal. A SIGTERM to rank 1 in
    step 12 stops every rank after that validation run: each run and step is done once
    (Lightning 2.4 runs that validation again). On Lightning 2.4 the resumed epoch counts
    the snapshot's batch done (``complete_saved_batch``), or the next run comes a batch late."""
    runs = {
        "validate/straight": ("validate", "-1"),
        "validate/killed": ("validate", "12"),
        "validate/sigterm1": ("validate", "11"),
    }
    outputs = run_and_compare(tmp_path, shm, runs)
    out = tmp_path / "validate"
    for name in ("killed", "sigterm1"):
        assert same_weights(out / name / "final.pt", out / "straight" / "final.pt"), name
    for rank in (0, 1):
        assert done_twice(out / "killed", rank) == [12], (rank, done_twice(out / "killed", rank))
        # SIGTERM in step 12: the ranks stop after the validation run that follows it
        # (which Lightning 2.4 runs again as it resumes from there: docs/elastic.md).
        runs_by_attempt = (out / "sigterm1" / f"val.rank{rank}").read_text().splitlines()
        again = (12,) if lightning_before(2, 5) else ()
        assert runs_by_attempt == [
            *(f"val {s} attempt 0" for s in (4, 8, 12)),
            *(f"val {s} attempt 1" for s in (*again, 16, 20, 24)),
        ], (rank, runs_by_attempt)
    assert_stopped_together(out / "sigterm1", outputs["validate/sigterm1"], stop=12)


@pytest.mark.timeout(600)  # a hang guard: one torchrun job of two fits
def test_a_comm_hooks_state_is_in_trainer_checkpoints(tmp_path: Path) -> None:
    """PowerSGD: a checkpoint saved after step 16 (rank 0 writes it; each rank's error
    feedback is gathered into it), resumed by a new fit with ``ckpt_path``: bit-equal to the
    fit that went on."""
    torchrun(SCRIPT, "checkpoint", str(tmp_path), "16", restarts=0, env={"ELASTIC_POWERSGD": "1"})
    assert same_weights(tmp_path / "final.pt", tmp_path / "straight.pt")
    for rank in (0, 1):
        steps = (tmp_path / f"steps.rank{rank}").read_text().split()[1::4]
        assert steps == [str(s) for s in range(17, 25)], (rank, steps)  # steps 17 to 24


@pytest.mark.timeout(900)  # a hang guard: two torchrun jobs of Lightning
def test_a_rank_killed_after_fit_returned_trains_nothing_again(
    tmp_path: Path, shm: Path, straight: Path
) -> None:
    families = ("trainer", "fabric")

    def run(family: str) -> str:
        out = tmp_path / family
        out.mkdir()
        env = {"BUCKETDDP_SNAPSHOT_DIR": str(shm / family), "ELASTIC_AFTER_FIT": "1"}
        # 2 restarts: attempt 1 is not the last, so its clean exits remove the snapshots.
        return torchrun(SCRIPT, family, str(out), "-1", restarts=2, env=env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        outputs = dict(zip(families, pool.map(run, families), strict=True))
    for family, output in outputs.items():
        out = tmp_path / family
        assert_trained_once(out, output, shm / family)
        assert same_weights(out / "final.pt", straight / family / "final.pt"), family
    resumed = "resuming from this job's snapshot (the end of the fit at step 24, attempt 0"
    assert resumed in outputs["trainer"], outputs["trainer"][-3000:]


def _agent(
    out: Path, port: int, host: bool, env: dict[str, str], mode: str = "nodes", kill: str = "11"
) -> subprocess.Popen[bytes]:
    cmd = [*agent(port, host=host), str(SCRIPT), mode, str(out), kill]
    return start(cmd, out / f"agent{'A' if host else 'B'}.log", env)


@pytest.mark.timeout(900)  # a hang guard: several torchrun jobs of Lightning
def test_a_lost_node_leaves_the_rest_training_on_every_row_once(tmp_path: Path, shm: Path) -> None:
    log = _lose_a_node(tmp_path, shm, {})
    assert (tmp_path / "done.rank0").read_text().split() == ["world", "1", "seen", "192"]
    assert RESIZED_WARNING not in log  # Lightning's own sampler: resumed at any size
    rows = rows_by_epoch(tmp_path)  # each step's rows once: up to the snapshot, then after
    assert sorted(rows) == [0, 1, 2]
    for epoch, count in rows.items():
        assert count == Counter(range(64)), f"epoch {epoch}: rows lost or used twice"


@pytest.mark.timeout(600)  # a hang guard: two torchrun agents of Fabric
def test_a_lost_node_under_fabric_trains_every_row_once(tmp_path: Path, shm: Path) -> None:
    # Fabric's own sampler, from a shuffled loader through setup_dataloaders: the strategy
    # draws it through a CountingSampler, which splits the rest of the epoch over the
    # ranks left.
    log = _lose_a_node(tmp_path, shm, {}, mode="fabric_nodes")
    assert (tmp_path / "done.rank0").read_text().split() == ["world", "1", "seen", "192"]
    assert RESIZED_WARNING not in log
    rows = rows_by_epoch(tmp_path)
    assert sorted(rows) == [0, 1, 2]
    for epoch, count in rows.items():
        assert count == Counter(range(64)), f"epoch {epoch}: rows lost or used twice"


RESIZED_WARNING = "cannot split the rest of its epoch over another number of ranks"


@pytest.mark.timeout(600)  # a hang guard: two torchrun agents of Lightning
def test_a_users_sampler_resumed_at_another_world_size_warns(tmp_path: Path, shm: Path) -> None:
    # A WeightedRandomSampler, which Lightning wraps for the ranks: its order at world size
    # 1 is another than at 2, so the rest of the epoch cannot be told apart; it says so.
    log = _lose_a_node(tmp_path, shm, {"ELASTIC_SAMPLER": "weighted"})
    assert (tmp_path / "done.rank0").read_text().split()[:2] == ["world", "1"]
    assert log.count(RESIZED_WARNING) == 1, log[-4000:]
    assert "(DistributedSamplerWrapper)" in log


@pytest.mark.compat("elastic")  # CI runs it with Lightning 2.4 and 2.5 too (compat --pinned)
@pytest.mark.timeout(900)  # a hang guard: two jobs of two torchrun agents of Lightning
def test_several_loaders_resumed_at_another_world_size_use_each_row_once(
    tmp_path: Path, shm: Path
) -> None:
    # Two loaders: a (8 batches a pass on 2 ranks) and b (11, the epoch's length). In
    # max_size_cycle, a node lost after step 9 (a one batch into its second pass): the
    # epoch ends where b's rows run out at world size 1, each of them used once, and a's
    # rows once per pass; lost after step 11 (the epoch's end), the same. In min_size
    # (epochs end with a), lost after step 5: a's rows once an epoch, and as many of b's as
    # a's batches take, none twice.
    for mode, kill in (("max_size_cycle", "9"), ("max_size_cycle", "11"), ("min_size", "5")):
        out = tmp_path / f"{mode}-{kill}"
        out.mkdir()
        env = {"ELASTIC_LOADERS": "2", "ELASTIC_LOADERS_MODE": mode}
        log = _lose_a_node(out, shm / out.name, env, kill=kill)
        assert (out / "done.rank0").read_text().split()[:2] == ["world", "1"]
        assert "training loaders" not in log, log[-4000:]  # nothing warned
        rows = rows_by_epoch(out)
        assert sorted(rows) == [0, 1, 2]
        for epoch, count in rows.items():
            a = Counter({row: n for row, n in count.items() if row < 100})
            b = count - a
            if mode == "min_size":
                assert a == Counter(range(64)), f"{mode}, epoch {epoch}: a's rows"
                assert max(b.values()) == 1 and b.total() == 48, (mode, epoch, b)
            else:
                assert b == Counter(range(100, 164)), f"{mode}, epoch {epoch}: b's rows"
                # a: a whole pass, then 24 rows of the next, cut where b ends the epoch
                assert set(a) == set(range(64)) and max(a.values()) == 2, (mode, epoch, a)
                assert a.total() == 88, (mode, epoch, a)  # as at world size 2 and 1 alike


def _lose_a_node(
    tmp_path: Path, shm: Path, extra: dict[str, str], mode: str = "nodes", kill: str = "11"
) -> str:
    """Two agents, one worker each; the victim's worker kills itself and its agent once
    ``kill`` steps are done. The survivor finishes at world size 1; its log is returned."""
    port = free_port()
    env = {"BUCKETDDP_SNAPSHOT_DIR": str(shm), **extra}
    survivor = _agent(tmp_path, port, host=True, env=env, mode=mode, kill=kill)  # the store
    victim_env = {**env, "ELASTIC_VICTIM": "1"}
    victim = _agent(tmp_path, port, host=False, env=victim_env, mode=mode, kill=kill)
    try:
        assert survivor.wait(timeout=240) == 0, (tmp_path / "agentA.log").read_text()[-4000:]
        assert victim.wait(timeout=30) == -signal.SIGKILL  # its worker killed it at step 11
    finally:
        for proc in (survivor, victim):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return (tmp_path / "agentA.log").read_text()


def _steps(out: Path, rank: int) -> list[int]:
    log = (out / f"steps.rank{rank}").read_text().split()
    return [int(step) for step in log[1::4]]


@pytest.mark.timeout(600)  # a hang guard: two torchrun jobs of Lightning
def test_a_whole_job_preemption_resumes_from_disk(
    tmp_path: Path, shm: Path, straight: Path
) -> None:
    out, disk = tmp_path / "out", tmp_path / "disk"
    out.mkdir()
    env = {"BUCKETDDP_SNAPSHOT_DIR": str(shm), "BUCKETDDP_PREEMPT_DIR": str(disk)}
    first = subprocess.run(
        [*standalone(1), str(SCRIPT), "trainer", str(out), "13"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, **env, "ELASTIC_SIGNAL": "AGENT"},
    )
    output = first.stdout + first.stderr
    assert first.returncode != 0, output[-3000:]  # the agent was stopped: the job ended
    assert f"whose snapshot is in {disk}, where the job resumes from" in output, output[-3000:]
    assert "terminate called" not in output, output[-3000:]
    for rank in (0, 1):
        assert _steps(out, rank) == list(range(1, 15)), (rank, output[-3000:])
    kinds = sorted(p.name.split(".")[2] + "." + p.suffix for p in disk.iterdir() if p.name != "key")
    assert kinds == ["l0..data", "l0..meta", "l1..data", "l1..meta"], sorted(disk.iterdir())
    assert not any(shm.glob("**/*")), sorted(shm.glob("**/*"))  # on disk now, not in memory
    again = torchrun(
        SCRIPT,
        "trainer",
        str(out),
        "13",
        env={**env, "ELASTIC_SIGNAL": "AGENT", "ELASTIC_RERUN": "1"},
    )
    assert f"step 14, from the disk folder {disk}" in again, again[-3000:]
    for rank in (0, 1):
        assert _steps(out, rank) == list(range(1, 25)), rank  # 15 to 24 in the rerun
    assert same_weights(out / "final.pt", straight / "trainer" / "final.pt")
    assert sorted(p.name for p in disk.iterdir()) == [], "the finished job left its disk copy"
    assert not any(shm.glob("**/*")), sorted(shm.glob("**/*"))


def _srun(
    out: Path, port: int, restart: int, bin_dir: Path, shm: Path
) -> list[subprocess.Popen[bytes]]:
    """The two tasks ``srun --ntasks=2`` would start on one node, in job 4242 (its
    ``restart``-th requeue), with ``bin_dir`` first on ``PATH``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "SLURM"))}
    env.update(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="train",
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_TASKS_PER_NODE="2",
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_NODELIST="127.0.0.1",
        SLURM_RESTART_COUNT=str(restart),
        MASTER_PORT=str(port),
        BUCKETDDP_SNAPSHOT_DIR=str(shm),
        ELASTIC_SIGNAL="USR1",
        PATH=f"{bin_dir}:{env['PATH']}",
    )
    procs = []
    for rank in (0, 1):
        log = open(out / f"task{rank}.restart{restart}.log", "wb")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), "trainer", str(out), "13"],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
                start_new_session=True,
            )
        )
    return procs


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.timeout(600)  # a hang guard: two runs of a Lightning job
def test_slurm_auto_requeue_resumes_from_disk(tmp_path: Path, shm: Path, straight: Path) -> None:
    out, bin_dir = tmp_path / "out", tmp_path / "bin"
    out.mkdir()
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.calls\n')
    scontrol.chmod(0o755)
    codes = _wait(_srun(out, free_port(), 0, bin_dir, shm), timeout=300)
    logs = "".join(p.read_text() for p in sorted(out.glob("task*.restart0.log")))
    assert codes == [128 + signal.SIGUSR1] * 2, (codes, logs[-3000:])
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n", logs[-3000:]
    assert "requeued SLURM job 4242" in logs, logs[-3000:]
    for rank in (0, 1):
        assert _steps(out, rank) == list(range(1, 15)), (rank, logs[-3000:])
    assert not any(shm.glob("**/*")), sorted(shm.glob("**/*"))
    codes = _wait(_srun(out, free_port(), 1, bin_dir, shm), timeout=300)
    logs = "".join(p.read_text() for p in sorted(out.glob("task*.restart1.log")))
    assert codes == [0, 0], (codes, logs[-3000:])
    assert "step 14, from the disk folder" in logs, logs[-3000:]
    for rank in (0, 1):
        assert _steps(out, rank) == list(range(1, 25)), rank  # 15 to 24 once requeued
    assert same_weights(out / "final.pt", straight / "trainer" / "final.pt")
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n"  # not again
    assert not any(shm.glob("**/*")), sorted(shm.glob("**/*"))


def test_elastic_without_torchrun_says_it_takes_no_snapshots(tmp_path: Path) -> None:
    code = (
        "import lightning.pytorch as pl, torch, warnings\n"
        "from lightning.pytorch.demos.boring_classes import BoringModel\n"
        "from bucketddp import BucketDDP\n"
        "t = pl.Trainer(accelerator='cpu', devices=1, max_steps=1, logger=False,\n"
        "    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,\n"
        "    strategy=BucketDDP(elastic=True))\n"
        "t.fit(BoringModel())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "elastic training takes no snapshots in this run: it needs torchrun" in out.stderr
