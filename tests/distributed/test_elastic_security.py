"""Snapshots that no other user can read or plant: real torchrun jobs, files really planted.

- A job whose own folder holds files it did not write (a meta of the newest step with
  another key's tag, a meta in the pickled format of earlier versions, and one with the
  job's tag but no step; each would make a marker folder if unpickled) skips each with a
  warning naming it, never runs their code, and resumes after a SIGKILL bit-equal to a job
  never interrupted. It runs with umask 0, yet every snapshot folder and file it has
  while training has no group or other permission bits.
- Another user (uid 65534: needs root) makes the job's folder of earlier versions
  (``<root>/bucketddp-<run id>``), world-writable, with code-running metas: the job never
  reads it and trains in its own. Where that user made the job's per-user parent first,
  every rank refuses before training, naming the folder and its owner.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from elastic_planted import PLANTED, forged_meta, old_format_meta
from elastic_runs import done_twice, same_weights, standalone
from lightning_runs import ROOT, SUPPORT, run_script, torchrun

pytestmark = pytest.mark.jobs  # torchrun jobs resuming from planted snapshots

LOOP = SUPPORT / "elastic_loop.py"
NOBODY = 65534


def test_files_the_job_did_not_write_are_skipped_and_it_resumes_bit_equal(
    tmp_path: Path, shm: Path
) -> None:
    runs = {"straight": ("-1", {}), "planted": ("11", {"ELASTIC_PLANT": "1"})}

    def run(name: str) -> str:
        (tmp_path / name).mkdir()
        kill, env = runs[name]
        env = {**env, "BUCKETDDP_SNAPSHOT_DIR": str(shm / name)}
        return torchrun(LOOP, str(tmp_path / name), kill, env=env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        logs = dict(zip(runs, pool.map(run, runs), strict=True))
    out = tmp_path / "planted"
    assert same_weights(out / "final.pt", tmp_path / "straight" / "final.pt")
    assert "attempt 1" in (out / "steps.rank1").read_text()  # it did restart
    # ... after the planned kill, not earlier: attempt 0 reached step 11.
    assert "step 11 attempt 0" in (out / "steps.rank0").read_text(), logs["planted"][-4000:]
    assert all(len(done_twice(out, rank)) <= 1 for rank in (0, 1))
    assert not (out / "marker").exists(), "a planted meta was unpickled"
    skipped = [line for line in logs["planted"].splitlines() if "skipping snapshot meta" in line]
    reasons = ("tag does not check", "not a snapshot meta", "'step'")
    for name, why in zip(PLANTED, reasons, strict=True):
        assert any(name in line and why in line for line in skipped), (name, skipped)
    # The modes while training, in attempt 0 and after the restart: the per-user parent,
    # the job's folder, its key and every data and meta file.
    modes = (out / "modes").read_text().split("\n")
    entries = [line.split(" ", 1) for line in modes if line]
    assert all(int(mode, 8) & 0o077 == 0 for mode, _ in entries), modes
    names = {Path(path).name for _, path in entries}
    assert {f"bucketddp-{os.geteuid()}", "key", "a0.n0.l1.s1.data", "a1.n0.l0.s0.meta"} <= names
    assert not any(shm.glob("**/*.meta")), "snapshots left after a clean finish"


def _as_nobody(make: list[tuple[Path, bytes | None]]) -> None:
    """Make each folder (None) or file, world-writable, as uid 65534 (a forked child)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.umask(0)
            for path, data in make:
                if data is None:
                    path.mkdir(mode=0o777)
                else:
                    path.write_bytes(data)
            os._exit(0)
        except BaseException:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] == 0, "the planting child failed"


@pytest.mark.skipif(os.geteuid() != 0, reason="planting as another user needs root")
def test_a_folder_another_user_made_is_never_read(tmp_path: Path, shm: Path) -> None:
    marker = str(tmp_path / "marker")
    metas = [
        ("a0.n0.l0.s0.meta", old_format_meta(marker)),
        ("a9.n0.l0.s0.meta", forged_meta(marker)),
    ]
    old, parent = shm / "old", shm / "parent"
    for root in (old, parent):
        root.mkdir(parents=True)
        root.chmod(0o1777)  # as /dev/shm: everyone may make a folder in it
    run = "planted-job"
    theirs = [old / f"bucketddp-{run}", parent / "bucketddp-0", parent / "bucketddp-0" / run]
    _as_nobody(
        [(theirs[0], None), (theirs[1], None), (theirs[2], None)]
        + [(folder / name, data) for folder in (theirs[0], theirs[2]) for name, data in metas]
    )
    for name in ("old", "parent"):
        (tmp_path / name).mkdir()
    cmd = [*standalone(0, run_id=run), str(LOOP)]

    def refused() -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "BUCKETDDP_SNAPSHOT_DIR": str(parent)}
        args = [*cmd, str(tmp_path / "parent"), "-1"]
        return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)

    with ThreadPoolExecutor(max_workers=2) as pool:
        refusing = pool.submit(refused)
        env = {"BUCKETDDP_SNAPSHOT_DIR": str(old)}
        run_script([*cmd, str(tmp_path / "old"), "-1"], timeout=240, env=env)
        result = refusing.result()
    # The folder of earlier versions is left as its owner made it; the job used its own.
    assert sorted(p.name for p in theirs[0].iterdir()) == sorted(n for n, _ in metas)
    assert (tmp_path / "old" / "final.pt").exists()
    # The planted per-user parent: every rank refuses before training, naming it.
    assert result.returncode != 0
    text = result.stdout + result.stderr
    for rank in (0, 1):
        assert (
            f"rank {rank} (node 0): bucketddp: refusing the snapshot folder: {theirs[1]} "
            "belongs to another user" in text
        ), text[-3000:]
    assert "nobody (uid 65534)" in text
    assert not (tmp_path / "parent" / "steps.rank0").exists()
    assert not Path(marker).exists(), "a planted meta was unpickled"
