#!/usr/bin/env python3
"""Project entry points that need nothing but Python 3.10+ and pip.

    python3 dev.py demo    # learn digits on 2 CPU processes, bucketddp beside torch DDP
    python3 dev.py test    # the test suite but the whole programs (-m jobs; --all for both)
    python3 dev.py lint    # ruff, mypy, and the layer contracts (import-linter)
    python3 dev.py bench   # the engine benchmark (bucketddp vs torch DDP vs no communication)
    python3 dev.py bench-elastic   # elastic snapshots: step-time cost, shared memory, recovery
    python3 dev.py bench-exits   # clean exits under load: exits by a signal, per entry point
    python3 dev.py bench-collectives   # collectives per step with and without elastic snapshots
    python3 dev.py plots   # redraw docs/images: the bucket-size sweep and the overlap timeline
    python3 dev.py convergence   # accuracy with each comm hook, bucketddp and torch DDP
    python3 dev.py bench-lightning   # Trainer.fit ms/step, BucketDDP against strategy="ddp"
    python3 dev.py bench-syncbn   # SyncBatchNorm's step-time overhead against plain BatchNorm
    python3 dev.py bench-checkpoint   # peak memory of a rank receiving a checkpoint
    python3 dev.py ratio-plot FILE...   # docs/images/ratios.png from `bench` JSON reports (pooled)
    python3 dev.py startup-cost   # what the interpreter-start hook costs every Python program
    python3 dev.py error-exits   # how often a failing 2-rank script ends a rank by a signal
    python3 dev.py fault-matrix   # docs/reliability.md's fault matrix: rank 1 fails at step 5
    python3 dev.py fuzz    # the engine fuzzer, outside the suite: --schedules 200, --replay SEED
    python3 dev.py fuzz-lightning   # the strategy fuzzer against "ddp": --schedules 100
    python3 dev.py scaleup-repro   # torchrun's scale-up without bucketddp: --no-share
    python3 dev.py fork-repro   # a forked child that hangs on Python < 3.11.10: --guard
    python3 dev.py compat  # the compat subset on each supported torch x Lightning x Python:
                           # --only 'torch 2.6' (see tools/compat.py), --list
    python3 dev.py wheel   # build the sdist and wheel, twine check, run two examples from the wheel
    python3 dev.py docs    # build the docs site strictly into docs/_build/html

A command passes what follows its name to its script (`python3 dev.py fuzz --help`). The
benchmarks are in benchmarks/, the fuzzers, the wheel check and the compat runner in tools/.

The first call creates .venv and installs the project into it (editable) with the versions
pinned in constraints.txt. Later calls reuse it until pyproject.toml or constraints.txt
change; wheel and docs add their own extras ("release", "docs") to it the first time they
run. `demo` has an environment of its own, .venv-demo, with only what the demo needs
(torch and scikit-learn, the "demo" extra), so a first run installs no Lightning and no
development tools.

Which torch build pip installs is pip's choice: on Linux the package index's torch is the
CUDA build (about 2.5 GB with its nvidia packages). For the CPU-only build, install it first
from PyTorch's CPU index, as docs/getting-started.md shows:
    .venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
DEMO_VENV = ROOT / ".venv-demo"
CONSTRAINTS = ROOT / "constraints.txt"

# import-linter's contracts (pyproject.toml); no cache file in the tree.
LINT_IMPORTS = (
    "from importlinter.cli import lint_imports_command as c; c(['--no-cache', '--no-logo'])"
)
COMMANDS = {
    "demo": [["examples/demo.py"]],
    "test": [["-m", "pytest", "-q"]],
    "bench": [["benchmarks/bench_engine.py"]],
    "bench-elastic": [["benchmarks/bench_elastic.py"]],
    "bench-exits": [["benchmarks/bench_exits.py"]],
    "bench-collectives": [["benchmarks/bench_elastic_collectives.py"]],
    "plots": [["benchmarks/bench_plots.py"]],
    "convergence": [["benchmarks/bench_convergence.py"]],
    "bench-lightning": [["benchmarks/bench_lightning.py"]],
    "bench-syncbn": [["benchmarks/bench_syncbn.py"]],
    "bench-checkpoint": [["benchmarks/checkpoint_memory.py"]],
    "ratio-plot": [["benchmarks/bench_ratio_plot.py"]],
    "startup-cost": [["benchmarks/startup_cost.py"]],
    "error-exits": [["benchmarks/error_exit_status.py"]],
    "fault-matrix": [["benchmarks/fault_matrix.py"]],
    "fuzz": [["tools/fuzz_engine.py"]],
    "fuzz-lightning": [["tools/fuzz_lightning.py"]],
    "scaleup-repro": [["tools/scaleup_repro.py"]],
    "fork-repro": [["tools/fork_repro.py"]],
    # Runs on the Python that runs dev.py (SYSTEM_PYTHON): its environments are its own.
    "compat": [["tools/compat.py"]],
    "lint": [
        [
            "-m",
            "ruff",
            "check",
            "src",
            "tests",
            "examples",
            "benchmarks",
            "docs",
            "tools",
            "dev.py",
        ],
        ["-m", "mypy"],
        ["-c", LINT_IMPORTS],
    ],
    "wheel": [["tools/check_wheel.py"]],
    "docs": [
        # -E: read every page again (an unchanged page would not repeat its warnings);
        # -W: warnings are errors; --keep-going: report all of them, not just the first.
        [
            "-m",
            "sphinx",
            "-E",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "docs",
            "docs/_build/html",
        ],
        ["-m", "pytest", "-q", "tests/docs"],
    ],
}
# The extras each command needs beyond the default ones.
DEFAULT_EXTRAS = ("lightning", "dev")
EXTRAS = {"wheel": ("release",), "docs": ("docs",)}
# Commands with an environment of their own, and its only extras.
OWN_VENV = {"demo": (DEMO_VENV, ("demo",))}
# Commands that run on the Python running dev.py, outside the repository's environments.
SYSTEM_PYTHON = {"compat"}


def _python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _fingerprint() -> str:
    digest = hashlib.sha256()
    for name in ("pyproject.toml", "constraints.txt"):
        digest.update((ROOT / name).read_bytes())
    return digest.hexdigest()


def ensure_venv(extras: tuple[str, ...] = DEFAULT_EXTRAS, venv: Path = VENV) -> Path:
    """Create ``venv`` and install the project into it, unless it is already current;
    return its Python.

    The stamp records the pins' fingerprint and the extras installed: a command that needs
    another extra adds it, and the extras already there stay.
    """
    py = _python(venv)
    stamp = venv / ".installed"
    want = _fingerprint()
    lines = stamp.read_text().splitlines() if stamp.exists() else []
    had = set(lines[1].split(",")) if len(lines) > 1 else set()
    need = set(extras)
    if lines[:1] == [want] and need <= had and py.exists():
        return py
    need |= had
    env = dict(os.environ, PIP_CONSTRAINT=str(CONSTRAINTS), PIP_DISABLE_PIP_VERSION_CHECK="1")
    if not py.exists():
        made = subprocess.run([sys.executable, "-m", "venv", str(venv)], check=False)
        if made.returncode != 0:
            # Some distributions ship venv without ensurepip: make a bare venv and let the
            # system pip install into it.
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    has_pip = subprocess.run([str(py), "-m", "pip", "--version"], capture_output=True).returncode
    pip = [str(py), "-m", "pip"]
    if has_pip != 0:
        pip = [sys.executable, "-m", "pip", "--python", str(py)]
    print(
        f"dev.py: installing bucketddp and its pinned dependencies into {venv.name} ...",
        flush=True,
    )
    spec = f".[{','.join(sorted(need))}]"
    subprocess.run([*pip, "install", "-q", "-e", spec], cwd=ROOT, env=env, check=True)
    stamp.write_text(f"{want}\n{','.join(sorted(need))}\n")
    return py


def main(argv: list[str]) -> int:
    """Run the named command inside the project's virtual environment."""
    if len(argv) < 1 or argv[0] not in COMMANDS:
        print(__doc__)
        return 2
    if argv[0] in SYSTEM_PYTHON:
        # Its environments are its own (tools/compat.py), outside the repository.
        ((script, *args),) = COMMANDS[argv[0]]
        return subprocess.run([sys.executable, str(ROOT / script), *args, *argv[1:]]).returncode
    if argv[0] in OWN_VENV:
        venv, extras = OWN_VENV[argv[0]]
        py = ensure_venv(extras, venv)
    else:
        py = ensure_venv((*DEFAULT_EXTRAS, *EXTRAS.get(argv[0], ())))
    for cmd in COMMANDS[argv[0]]:
        code = subprocess.run([str(py), *cmd, *argv[1:]], cwd=ROOT).returncode
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
