"""The runs of ``elastic_lightning.py`` that tests/lightning/test_elastic_*.py compare."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from elastic_runs import assert_stopped_together, done_twice, same_weights
from lightning_runs import SUPPORT, torchrun

SCRIPT = SUPPORT / "elastic_lightning.py"
"""Lightning under torchrun with elastic snapshots (its docstring says what each mode does)."""


def lightning_before(major: int, minor: int) -> bool:
    """Whether the Lightning installed is older than ``major.minor``."""
    import lightning

    return tuple(int(part) for part in lightning.__version__.split(".")[:2]) < (major, minor)


def run_and_compare(
    tmp_path: Path,
    shm: Path,
    runs: dict[str, tuple[str, str]],
    straight: Path | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, str]:
    """Run ``runs`` (name: mode, step), 3 at a time (``env`` added to each), and compare
    each with the uninterrupted run of its family in ``straight`` (with none given: only
    run them). Returns each run's output."""
    outputs: dict[str, str] = {}

    def run(name: str) -> None:
        out = tmp_path / name
        out.mkdir(parents=True)
        mode, kill = runs[name]
        job = {"BUCKETDDP_SNAPSHOT_DIR": str(shm / name.replace("/", "-")), **(env or {})}
        if "sigterm" in name:
            job.update(ELASTIC_SIGNAL="TERM", ELASTIC_SIGNAL_RANK=name[-1])
        outputs[name] = torchrun(SCRIPT, mode, str(out), kill, env=job)

    with ThreadPoolExecutor(max_workers=3) as pool:
        list(pool.map(run, runs))
    left = sorted(str(p.relative_to(shm)) for p in shm.glob("**/*") if p.is_file())
    named = {n: o[-3000:] for n, o in outputs.items() if n.replace("/", "-") in str(left)}
    assert not left, ("snapshots left after a clean finish", left, named)
    for name, output in outputs.items():  # ranks that remove them on their way out race
        assert "could not remove" not in output, (name, output[-3000:])
    if straight is None:
        return outputs
    for name in runs:
        out, family = tmp_path / name, name.split("/")[0]
        reference = straight / ("fabric" if family == "fabric" else "trainer")
        assert same_weights(out / "final.pt", reference / "final.pt"), name
        for rank in (0, 1):
            assert len(done_twice(out, rank)) <= 1, (name, rank, done_twice(out, rank))
        written = sorted(p.name for p in out.iterdir())
        assert written == ["final.pt", "steps.rank0", "steps.rank1"], (name, written)
        if "sigterm" in name:
            assert_stopped_together(out, outputs[name], stop=14)
        else:
            assert "attempt 1" in (out / "steps.rank1").read_text(), f"{name} did not restart"
    return outputs
