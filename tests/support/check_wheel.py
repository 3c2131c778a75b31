"""Build the sdist and the wheel, check them, and run two examples from the installed wheel.

    python3 dev.py wheel

1. ``python -m build`` makes the sdist, then the wheel from the sdist, into dist/.
2. ``twine check --strict`` checks both; the wheel must hold ``py.typed`` and carry the
   version written in ``bucketddp.__version__``.
3. A new virtual environment, outside the source tree, gets the wheel with its
   ``lightning`` extra through constraints.txt (so torch is the pinned CPU build).
4. From a directory outside the source tree, that environment imports bucketddp (which
   must come from the environment, not from src/) and runs examples/lightning_swap.py
   and examples/fabric_loop.py.

Each step prints how long it took. The environment is deleted at the end.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "dist"
EXAMPLES = ["examples/lightning_swap.py", "examples/fabric_loop.py"]


def _version() -> str:
    """``__version__`` as written in src/bucketddp/__init__.py, read without importing it."""
    tree = ast.parse((ROOT / "src/bucketddp/__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            return str(ast.literal_eval(node.value))
    raise SystemExit("check_wheel: src/bucketddp/__init__.py sets no __version__")


def _run(label: str, cmd: list[str], quiet: bool = False, **kwargs: Any) -> None:
    """Run ``cmd``, print how long it took, and stop with its output if it fails."""
    start = time.monotonic()
    print(f"check_wheel: {label} ...", flush=True)
    done = subprocess.run(cmd, capture_output=quiet, text=True, **kwargs)
    if done.returncode != 0:
        if quiet:
            print(done.stdout[-6000:], done.stderr[-6000:], sep="\n")
        raise SystemExit(f"check_wheel: {label} failed ({done.returncode})")
    print(f"check_wheel: {label}: {time.monotonic() - start:.0f} s", flush=True)


def _pip() -> list[str]:
    """A pip that can install into another environment (``pip --python``)."""
    for python in (sys.executable, getattr(sys, "_base_executable", sys.executable)):
        if subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return [python, "-m", "pip"]
    raise SystemExit("check_wheel: no pip found")


def main() -> int:
    """Run the four steps; return 0 when all pass."""
    total = time.monotonic()
    version = _version()
    env = dict(os.environ, PIP_CONSTRAINT=str(ROOT / "constraints.txt"))
    env.pop("PYTHONPATH", None)

    shutil.rmtree(DIST, ignore_errors=True)
    _run(
        "build",
        [sys.executable, "-m", "build", "--outdir", str(DIST), str(ROOT)],
        quiet=True,
        env=env,
    )
    wheels = sorted(DIST.glob("*.whl"))
    sdists = sorted(DIST.glob("*.tar.gz"))
    expected = [f"bucketddp-{version}-py3-none-any.whl"], [f"bucketddp-{version}.tar.gz"]
    if ([w.name for w in wheels], [s.name for s in sdists]) != expected:
        raise SystemExit(f"check_wheel: expected {expected} in dist/, found {os.listdir(DIST)}")
    _run(
        "twine check",
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, [*sdists, *wheels])],
    )
    with zipfile.ZipFile(wheels[0]) as wheel:
        if "bucketddp/py.typed" not in wheel.namelist():
            raise SystemExit("check_wheel: the wheel has no bucketddp/py.typed")

    with tempfile.TemporaryDirectory(prefix="bucketddp-wheel-") as tmp:
        venv = Path(tmp) / "venv"
        python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
        _run("new venv", [sys.executable, "-m", "venv", "--without-pip", str(venv)])
        # --no-compile: byte-compiling all of torch costs more than the whole install.
        install = [*_pip(), "--python", str(python), "install", "-q", "--no-compile"]
        _run("install the wheel", [*install, f"{wheels[0]}[lightning]"], quiet=True, env=env)

        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        where = subprocess.run(
            [
                str(python),
                "-c",
                "import bucketddp; print(bucketddp.__file__, bucketddp.__version__)",
            ],
            cwd=run_dir,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        print(f"check_wheel: bucketddp {where[1]} imported from {where[0]}")
        if not Path(where[0]).resolve().is_relative_to(venv.resolve()) or where[1] != version:
            raise SystemExit(f"check_wheel: expected bucketddp {version} from {venv}")
        for example in EXAMPLES:
            _run(example, [str(python), str(ROOT / example)], cwd=run_dir, env=env)

    print(f"check_wheel: all passed in {time.monotonic() - total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
