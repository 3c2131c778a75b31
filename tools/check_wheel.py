"""Build the sdist and the wheel, check them, and run two examples from the installed wheel.

    python3 dev.py wheel

1. ``python -m build`` makes the sdist, then the wheel from the sdist, into dist/.
2. ``twine check --strict`` checks both; the wheel must hold ``py.typed`` and carry the
   version written in ``bucketddp.__version__``; both must ship LICENSE and name it (and
   ``License-Expression: Apache-2.0``) in their metadata.
3. docs/getting-started.md's commands run as written (install_page.py): from a fresh copy
   of the repository into a new virtual environment outside the source tree, CPU-only
   torch, ``pip install .`` and ``".[lightning]"``, then the wheel with its ``lightning``
   extra, then the demo; every pip call goes through constraints.txt.
4. From a directory outside the source tree, that environment imports bucketddp (which
   must come from the environment, not from src/) and runs examples/lightning_swap.py
   and examples/fabric_loop.py.
5. A script that never imports bucketddp fits with ``Trainer(strategy="bucket_ddp")`` on
   2 CPU processes, and trains under ``fabric run --strategy bucket_ddp`` (the wheel's
   interpreter-start hook, docs/strategy.md); with the hook switched off the name is refused.

Each step prints how long it took. The environment is deleted at the end.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from install_page import install_as_the_page_says

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "dist"
EXAMPLES = ["examples/lightning_swap.py", "examples/fabric_loop.py"]
PTH = "bucketddp-strategy-names.pth"
"""The interpreter-start hook that registers our strategy names (setup.py)."""
NO_IMPORT_SCRIPT = ROOT / "tools" / "names_without_import.py"


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


def _check_license(wheel_path: Path, sdist_path: Path, version: str) -> None:
    """LICENSE ships in the wheel and the sdist, identical to the repository's, and both
    metadata files name it and the license expression."""
    license_text = (ROOT / "LICENSE").read_bytes()
    dist_info = f"bucketddp-{version}.dist-info"
    with zipfile.ZipFile(wheel_path) as wheel:
        names = set(wheel.namelist())
        if f"{dist_info}/licenses/LICENSE" not in names:
            raise SystemExit(f"check_wheel: the wheel has no {dist_info}/licenses/LICENSE")
        shipped = wheel.read(f"{dist_info}/licenses/LICENSE")
        metadata = wheel.read(f"{dist_info}/METADATA").decode()
    with tarfile.open(sdist_path) as sdist:
        member = sdist.extractfile(f"bucketddp-{version}/LICENSE")
        pkg_info = sdist.extractfile(f"bucketddp-{version}/PKG-INFO")
        if member is None or pkg_info is None:
            raise SystemExit("check_wheel: the sdist has no LICENSE or PKG-INFO")
        in_sdist = member.read()
        sdist_metadata = pkg_info.read().decode()
    if shipped != license_text or in_sdist != license_text:
        raise SystemExit("check_wheel: the LICENSE shipped differs from the repository's")
    for where, text in (("wheel", metadata), ("sdist", sdist_metadata)):
        lines = text.splitlines()
        if "License-Expression: Apache-2.0" not in lines or "License-File: LICENSE" not in lines:
            raise SystemExit(f"check_wheel: the {where}'s metadata does not name the license")
    print("check_wheel: LICENSE is in the wheel and the sdist, and in their metadata")


def _check_names_without_import(venv: Path, run_dir: Path, env: dict[str, str]) -> None:
    """Our strategy names work in a script that never imports bucketddp (the wheel's
    interpreter-start hook), for the Trainer and through ``fabric run``; switched off with
    ``BUCKETDDP_NO_STARTUP_HOOK=1``, the Trainer refuses the name."""
    script = run_dir / NO_IMPORT_SCRIPT.name
    shutil.copy(NO_IMPORT_SCRIPT, script)
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = str(bin_dir / "python")
    _run(
        "Trainer(strategy='bucket_ddp'), no import",
        [python, str(script), "trainer"],
        cwd=run_dir,
        env=env,
    )
    fabric_run = [str(bin_dir / "fabric"), "run", "--accelerator", "cpu", "--devices", "2"]
    _run(
        "fabric run --strategy bucket_ddp, no import",
        [*fabric_run, "--strategy", "bucket_ddp", str(script), "fabric"],
        cwd=run_dir,
        env=env,
    )
    off = dict(env, BUCKETDDP_NO_STARTUP_HOOK="1")
    refused = subprocess.run(
        [python, str(script), "trainer"], cwd=run_dir, env=off, capture_output=True, text=True
    )
    if refused.returncode == 0 or "bucket_ddp" not in refused.stderr:
        raise SystemExit("check_wheel: BUCKETDDP_NO_STARTUP_HOOK=1 did not switch the hook off")
    print("check_wheel: with BUCKETDDP_NO_STARTUP_HOOK=1 the Trainer refuses 'bucket_ddp'")


def main() -> int:
    """Run the five steps; return 0 when all pass."""
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
        for name in ("bucketddp/py.typed", "_bucketddp_startup.py", PTH):
            if name not in wheel.namelist():
                raise SystemExit(f"check_wheel: the wheel has no {name}")
    _check_license(wheels[0], sdists[0], version)

    with tempfile.TemporaryDirectory(prefix="bucketddp-wheel-") as tmp:
        start = time.monotonic()
        print("check_wheel: docs/getting-started.md's commands ...", flush=True)
        venv = install_as_the_page_says(Path(tmp), env)
        print(f"check_wheel: the install page: {time.monotonic() - start:.0f} s", flush=True)
        python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")

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
        _check_names_without_import(venv, run_dir, env)

    print(f"check_wheel: all passed in {time.monotonic() - total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
