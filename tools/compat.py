"""``python3 dev.py compat``: the compatibility subset on each torch × Lightning × Python.

Each combination runs the tests marked ``@pytest.mark.compat("area")`` (one or two per
area: the engine against torch DDP, buffer policies, SyncBatchNorm, the watchdog, resume
from rank 0, a BucketDDP fit and Fabric against "ddp", the notebook) and the results go
into a table of combination × area, printed and written to docs/compatibility.md.

Environments live outside the repository, in ``~/.cache/bucketddp-compat`` (or
``$BUCKETDDP_COMPAT_CACHE``):

- ``wheels/``: every wheel downloaded from the package index, kept between runs, so a
  second run installs without the network;
- ``envs/pyX.Y-torchV/``: one virtual environment per Python and torch release, with torch,
  Lightning's dependencies and the test tools, and bucketddp installed editable from this
  checkout (torch's CUDA builds take about 5 GB each, so the Lightning minors share it);
- ``layers/pyX.Y/lightning-V/``: each Lightning release installed alone (``pip install
  --target --no-deps``), put in front of the environment through PYTHONPATH.

The package index's torch for Linux is the CUDA build (it runs on CPU). This machine's pip
configuration may cap torch through a constraints file; this command lifts the cap for its
own pip calls only (``PIP_CONSTRAINT`` empty).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("BUCKETDDP_COMPAT_CACHE", "~/.cache/bucketddp-compat")).expanduser()
WHEELS = CACHE / "wheels"
TABLE = ROOT / "docs" / "compatibility.md"
CONSTRAINTS = ROOT / "constraints.txt"

# The latest patch of each Lightning minor in the window.
LIGHTNING = {"2.4": "2.4.0", "2.5": "2.5.6", "2.6": "2.6.6"}
OLDEST_TORCH = "2.5.1"
NEWEST_TORCH = "2.15.0"
TORCHES = [OLDEST_TORCH, "2.6.0", "2.10.0", "2.13.0", NEWEST_TORCH]
AREAS = ["engine", "buffers", "syncbn", "watchdog", "resume", "fit", "fabric", "notebook"]
# The areas that import Lightning: all that --pinned runs, its torch being the pinned one.
# "elastic" (torchrun jobs: elastic fits resumed from an epoch's end, from a mid-epoch
# validation run and with two training loaders, also after a node lost) is run there only.
LIGHTNING_AREAS = ["fit", "fabric", "notebook", "elastic"]
# What the environments need besides torch and Lightning: the test tools, the optional
# packages the tests use, and Lightning's own dependencies (Lightning itself comes in a layer).
TEST_TOOLS = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "numpy",
    "nbclient>=0.10",
    "ipykernel>=6.29",
    "torchdata>=0.8",
    "torchmetrics>=1.3",
    "click>=8",
    "scikit-learn>=1.3",
    "setuptools>=77",
]


PINNED = "pinned"
"""A combination's torch that is the project's own .venv: constraints.txt's pins."""


@dataclass(frozen=True)
class Combo:
    """One row of the table: a Python, a torch release and a Lightning minor."""

    python: str
    torch: str  # a release on the package index, or PINNED
    lightning: str

    @property
    def name(self) -> str:
        torch = f"{pinned('torch')} (pinned)" if self.torch == PINNED else self.torch
        return f"py{self.python} torch {torch} Lightning {LIGHTNING[self.lightning]}"

    @property
    def env(self) -> Path:
        if self.torch == PINNED:
            return ROOT / ".venv"
        return CACHE / "envs" / f"py{self.python}-torch{self.torch}"

    @property
    def layer(self) -> Path:
        return CACHE / "layers" / f"py{self.python}" / f"lightning-{LIGHTNING[self.lightning]}"


COMBOS = [Combo("3.11", t, lit) for t in TORCHES for lit in LIGHTNING]
# The oldest Python with the oldest torch and Lightning, the newest with the newest.
COMBOS += [Combo("3.10", OLDEST_TORCH, "2.4"), Combo("3.13", NEWEST_TORCH, "2.6")]
# CI's (--pinned): the Lightning minors other than the pinned 2.6, on the project's .venv.
PINNED_COMBOS = [
    Combo(f"{sys.version_info.major}.{sys.version_info.minor}", PINNED, lit)
    for lit in LIGHTNING
    if lit != "2.6"
]


def pinned(name: str) -> str:
    """The version constraints.txt pins ``name`` to."""
    for line in CONSTRAINTS.read_text().splitlines():
        if line.startswith(f"{name}=="):
            return line.split("==", 1)[1].strip()
    raise SystemExit(f"compat: constraints.txt pins no {name}")


def _pip_env(constraints: Path | None = None) -> dict[str, str]:
    # Without a constraints file, or with ours: an empty PIP_CONSTRAINT alone does not lift
    # one set in a pip configuration file (pip falls back to the file), so the files are
    # left out too.
    return dict(
        os.environ,
        PIP_CONSTRAINT=str(constraints or ""),
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )


def _python(version: str) -> str:
    """An interpreter of ``version``: on PATH, or installed by pyenv (whose shim on PATH
    fails for a version that is not selected)."""
    candidates = [
        str(p / "bin" / "python")
        for p in (Path.home() / ".pyenv" / "versions").glob(f"{version}.*")
    ]
    candidates += filter(None, [shutil.which(f"python{version}")])
    for exe in sorted(candidates):
        if subprocess.run([exe, "-c", ""], capture_output=True).returncode == 0:
            return exe
    raise SystemExit(f"compat: no python{version} on PATH or under ~/.pyenv/versions")


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({done.returncode}); see {log}")


def _install(
    py: Path, requirements: list[str], log: Path, *extra: str, constraints: Path | None = None
) -> None:
    """Download ``requirements`` into the wheel cache (files already there are reused, so a
    second run needs no network), then install them from there alone."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    env = _pip_env(constraints)
    deps = ["--no-deps"] if "--no-deps" in extra else []
    fetch = [str(py), "-m", "pip", "download", "-q", "--only-binary=:all:", *deps]
    _run([*fetch, "-d", str(WHEELS), "--find-links", str(WHEELS), *requirements], log, env)
    install = [str(py), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(WHEELS)]
    _run([*install, *extra, *requirements], log, env)


def _without_lightning(log: Path) -> Path:
    """constraints.txt without its Lightning pins, for the layers of the other minors."""
    kept = [
        line
        for line in CONSTRAINTS.read_text().splitlines()
        if not line.startswith(("lightning==", "pytorch-lightning=="))
    ]
    path = log.with_suffix(".constraints.txt")
    path.write_text("\n".join(kept) + "\n")
    return path


def ensure_env(combo: Combo, log: Path) -> Path:
    """The Python of ``combo``'s environment, built if needed, and its Lightning layer."""
    py = combo.env / "bin" / "python"
    (CACHE / "locks").mkdir(parents=True, exist_ok=True)
    with open(CACHE / "locks" / combo.env.name, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run building the same environment
        _build(combo, py, log)
    return py


def _build(combo: Combo, py: Path, log: Path) -> None:
    if combo.torch == PINNED:
        sys.path.insert(0, str(ROOT))
        import dev  # the project's .venv, as `python3 dev.py test` makes it

        dev.ensure_venv()
    else:
        # Lightning's newest, for its dependencies; each combination's own comes in a layer.
        base = [f"torch=={combo.torch}", *TEST_TOOLS, f"lightning=={LIGHTNING['2.6']}"]
        stamp = combo.env / ".complete"
        if not stamp.exists():
            shutil.rmtree(combo.env, ignore_errors=True)
            _run([_python(combo.python), "-m", "venv", str(combo.env)], log)
        if not stamp.exists() or stamp.read_text() != " ".join(base):
            _install(py, base, log)  # an environment of an older list gets what is new
            stamp.write_text(" ".join(base))
    if not (combo.layer / ".complete").exists():
        shutil.rmtree(combo.layer, ignore_errors=True)
        want = f"lightning=={LIGHTNING[combo.lightning]}"
        # Lightning alone (no dependencies): torch is never resolved for a layer.
        pins = _without_lightning(log) if combo.torch == PINNED else None
        _install(py, [want], log, "--no-deps", "--target", str(combo.layer), constraints=pins)
        (combo.layer / ".complete").write_text(want)
    if combo.torch != PINNED:
        # The checkout under test, installed editable (with its metadata): a quick step.
        editable = ["-e", str(ROOT), "--no-deps", "--no-build-isolation", "--no-index"]
        _run([str(py), "-m", "pip", "install", "-q", *editable], log, _pip_env())


def run_combo(combo: Combo, logs: Path, pytest_args: list[str]) -> dict[str, str]:
    """Build ``combo``'s environment, run the compat subset in it; each area's result."""
    log = logs / (combo.name.replace(" ", "-") + ".log")
    log.unlink(missing_ok=True)
    areas = LIGHTNING_AREAS if combo.torch == PINNED else AREAS
    try:
        py = ensure_env(combo, log)
    except RuntimeError as err:
        print(f"  {err}", flush=True)
        return {area: "no env" for area in areas}
    report = logs / (combo.name.replace(" ", "-") + ".json")
    report.unlink(missing_ok=True)
    env = dict(os.environ, BUCKETDDP_COMPAT_REPORT=str(report))
    env["BUCKETDDP_COMPAT_AREAS"] = ",".join(areas)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(combo.layer), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    cmd = [str(py), "-m", "pytest", "-q", "-m", "compat", "-p", "no:cacheprovider", *pytest_args]
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    summary = log.read_text(errors="replace").strip().splitlines()[-1:]
    print(f"  pytest: {summary[0] if summary else '(no output)'}", flush=True)
    return results_of(combo, logs) or {area: "error" for area in areas}


def results_of(combo: Combo, logs: Path) -> dict[str, str] | None:
    """Each area's result in ``combo``'s latest run (None if it has none)."""
    report = logs / (combo.name.replace(" ", "-") + ".json")
    if not report.exists():
        return None
    areas = LIGHTNING_AREAS if combo.torch == PINNED else AREAS
    outcomes: dict[str, list[str]] = json.loads(report.read_text())
    results = {}
    for area in areas:
        seen = outcomes.get(area, [])
        if not seen:
            results[area] = "no test"
        elif all(o == "passed" for o in seen):
            results[area] = "pass"
        elif all(o in ("passed", "skipped") for o in seen):
            results[area] = "skip"
        else:
            results[area] = "FAIL"
    return results


def table(rows: dict[Combo, dict[str, str]]) -> str:
    areas = list(next(iter(rows.values())))
    lines = [
        "| Python | torch | Lightning | " + " | ".join(areas) + " |",
        "|---|---|---|" + "---|" * len(areas),
    ]
    for combo, results in rows.items():
        torch = f"{pinned('torch')} (pinned)" if combo.torch == PINNED else combo.torch
        cells = [combo.python, torch, LIGHTNING[combo.lightning]]
        lines.append("| " + " | ".join(cells + [results[a] for a in areas]) + " |")
    return "\n".join(lines)


POLICY = """
## Version bounds

The package states floors only: `torch>=2.5`, and `lightning>=2.4` in the `lightning`
extra. It sets no upper bound, so the day torch or Lightning ships a new release, pip
neither refuses to install bucketddp beside it nor downgrades it in an environment that
has it. The tested window is the table above, kept in `bucketddp/versions.py`: importing
bucketddp with a torch newer than the newest tested minor release, or its Lightning
strategies with a newer Lightning, warns once (`UntestedVersionWarning`, a `UserWarning`)
and goes on. A release older than the floor is refused: pip does not install it, and
`import bucketddp` raises on torch 2.4. `constraints.txt` pins the exact versions CI runs.

The strategies build on Lightning's public API, plus 19 private names that all live in
`bucketddp/lightning/internals.py`, each marked with the releases it was checked on
(2.4.0, 2.5.6 and 2.6.6). A new Lightning release that changes one of them fails there,
and in the compat run below.

A new release joins the window when `python3 dev.py compat --only 'torch 2.16'` passes on
it (or `--only 'Lightning 2.7'`): its row goes into this table and the newest release into
`bucketddp/versions.py` (a unit test checks that the two agree).

## Operating systems

bucketddp is tested on Linux. It needs a POSIX system: elastic training keeps its
snapshots in `/dev/shm`, and the watchdog's stall reports use POSIX signals. On macOS,
which has no `/dev/shm`, elastic training needs `BUCKETDDP_SNAPSHOT_DIR` set to a folder of
your choice; the rest is not tested there. Windows is not supported.
"""
"""The page's sections below the table, which no run changes."""


def write_page(rows: dict[Combo, dict[str, str]]) -> None:
    TABLE.write_text(
        "# Compatibility\n\n"
        "The releases bucketddp is tested with, as `python3 dev.py compat` measured them "
        f"(table written {time.strftime('%Y-%m-%d')}; each row is its combination's latest "
        "run). Each row "
        "is one environment installed from the package index: torch's CUDA build run on CPU "
        "(the CPU build where pip finds one, as for torch 2.13.0 on our machines), each "
        "Lightning release installed on top. Each column is one area of the test suite, the "
        "tests marked `compat` (`pytest -m compat --collect-only` lists them):\n\n"
        "- **engine**: `BucketDataParallel` against torch DDP (plain, `no_sync`, unused "
        "parameters), and the version fallbacks of `bucketddp/_compat.py`;\n"
        "- **buffers**: every buffer policy against its ground truth, and the default against "
        "torch DDP;\n"
        "- **syncbn**: `SyncBatchNorm` against BatchNorm on the global batch;\n"
        "- **watchdog**: a rank that raises, is killed or stalls is named on every rank, in a "
        "hand-written loop and under Lightning's launchers;\n"
        "- **resume**: a hand-written loop resumes from a checkpoint only rank 0 has;\n"
        '- **fit**: `Trainer(strategy=BucketDDP())` against `"ddp"`;\n'
        '- **fabric**: `BucketFabricDDP` against Fabric\'s `"ddp"` (save and load included);\n'
        "- **notebook**: examples/notebook.ipynb in a Jupyter kernel.\n\n"
        "`pass`: every test of the area passed; `FAIL`: at least one failed; `skip`: its "
        "tests skipped themselves on that release. The watchdog area also times how soon "
        "every rank is gone after the fault (10 s); on a machine busy with other work it "
        "can miss that, so a FAIL there is worth a second run (`--only`) before a closer "
        "look.\n\n"
        + table(rows)
        + "\n\nOlder torch: `import bucketddp` refuses torch 2.4, whose autograd engine skips "
        "a hook the reducer needs at the end of a reentrant checkpoint's backward. Python "
        "3.12 lies inside the window and is not run on its own.\n\n"
        "The full suite, not only this subset, runs in CI on the pinned stack "
        "(constraints.txt), followed by the Lightning areas with Lightning 2.4 and 2.5 on the "
        "pinned torch (`python3 dev.py compat --pinned`), and there also elastic fits "
        "killed at an epoch's end, in a mid-epoch validation run and mid-epoch with two "
        "training loaders, against the same fits "
        "uninterrupted (torchrun jobs, which the matrix leaves out).\n" + POLICY
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dev.py compat", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="run the combinations whose name contains TEXT, e.g. 'torch 2.6' or 'py3.13' "
        "(repeatable; a combination must contain every TEXT)",
    )
    parser.add_argument(
        "--pinned",
        action="store_true",
        help="CI's run: Lightning 2.4 and 2.5 on the project's pinned .venv (torch "
        "from constraints.txt), instead of the matrix",
    )
    parser.add_argument("--list", action="store_true", help="list the combinations and stop")
    parser.add_argument(
        "--no-write", action="store_true", help="print the table, leave docs/ alone"
    )
    args, pytest_args = parser.parse_known_args(argv)
    combos = PINNED_COMBOS if args.pinned else COMBOS
    chosen = [c for c in combos if all(text in c.name for text in args.only)]
    if args.list or not chosen:
        print("\n".join(c.name for c in combos))
        return 0 if chosen else 2
    logs = CACHE / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows: dict[Combo, dict[str, str]] = {}
    began = time.monotonic()
    for combo in chosen:
        start = time.monotonic()
        print(f"compat: {combo.name} ...", flush=True)
        rows[combo] = run_combo(combo, logs, pytest_args)
        took = time.monotonic() - start
        print(f"  {' '.join(f'{a}={r}' for a, r in rows[combo].items())} ({took:.0f} s)")
    print(table(rows))
    print(f"compat: {len(rows)} combinations in {(time.monotonic() - began) / 60:.1f} min")
    # The page: every combination's latest run, once each has one (a rerun of some with
    # --only updates their rows).
    latest = {combo: results_of(combo, logs) for combo in COMBOS}
    if not args.no_write and not args.pinned and all(latest.values()):
        write_page({combo: r for combo, r in latest.items() if r is not None})
        print(f"compat: wrote {TABLE.relative_to(ROOT)}, each row from its latest run")
    elif not args.no_write and not args.pinned:
        print("compat: docs/compatibility.md waits for a run of every combination")
    print(f"compat: logs in {logs}")
    ok = all(r in ("pass", "skip") for results in rows.values() for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
