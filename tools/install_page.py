"""Run docs/getting-started.md's commands as written, from a fresh copy of the repository
into a new virtual environment (check_wheel.py calls ``install_as_the_page_says``).

The page's ``bash`` blocks run in order in one bash session (``set -euxo pipefail``), in a
copy of the repository's files as a fresh clone has them (tracked, and new files not
ignored), with ``dist/`` from the build that check_wheel.py has just made. What the
harness adds, and why:

- PyTorch's CPU index (``https://download.pytorch.org/whl/cpu``) is out of reach in CI, and
  CI must not download torch: the URL is replaced by a local index in PyTorch's layout,
  holding the torch that constraints.txt pins (the CPU build on CI's disk) and its
  dependencies. Every pip call goes through constraints.txt (``PIP_CONSTRAINT``) and skips
  byte-compiling (``PIP_NO_COMPILE``), as every install in this repository does.
- After the clone's install: bucketddp imports from the environment, and no ``nvidia-*``
  package came with it. Before the wheel's: ``pip uninstall bucketddp`` (the page's
  "after ``pip uninstall bucketddp``"), so that the wheel is what gets installed. After
  the wheel's: ``click``, which Lightning's ``fabric run`` needs (check_wheel.py runs it).
- ``python3 dev.py wheel`` on the page is the command running this: its line is skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "getting-started.md"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
BLOCKS = ("venv", "cpu torch", "clone", "wheel", "demo")
"""What each bash block of the page does, in order: a page with other blocks fails here
until this harness is told what they are."""

_AFTER = {
    "clone": [
        "python -c \"import bucketddp, lightning; assert '/bucketddp-env/' in bucketddp.__file__\"",
        "if pip list 2>/dev/null | grep -i '^nvidia-'; then echo 'CUDA packages came'; exit 1; fi",
        "pip uninstall -y -q bucketddp",
    ],
    "wheel": ["pip install -q click"],
}
"""Lines the harness runs after a block (the checks named in the module docstring)."""


def page_blocks() -> list[str]:
    """The page's ``bash`` blocks, in order."""
    return re.findall(r"^```bash\n(.*?)^```$", PAGE.read_text(), flags=re.S | re.M)


def _fresh_copy(dest: Path) -> None:
    """The repository's files as a fresh clone (plus uncommitted work) has them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "dist", dest / "dist")


def _local_cpu_index(where: Path, env: dict[str, str]) -> Path:
    """A package index in PyTorch's layout (``<index>/<project>/<file>``) with the pinned
    torch and its dependencies, from pip's cache and the wheels on this machine."""
    files = where / "files"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "torch", "--dest", str(files)],
        env=env,
        check=True,
    )
    index = where / "index"
    for wheel in files.iterdir():
        project = index / re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
        project.mkdir(parents=True, exist_ok=True)
        (project / wheel.name).symlink_to(wheel)
    # pip reads a file:// index's project page from its index.html.
    for project in index.iterdir():
        links = (f'<a href="{w.name}">{w.name}</a><br>' for w in project.glob("*.whl"))
        (project / "index.html").write_text("\n".join(links) + "\n")
    return index


def install_as_the_page_says(tmp: Path, env: dict[str, str]) -> Path:
    """Run the page's commands in ``tmp``; return the environment they made."""
    blocks = page_blocks()
    if len(blocks) != len(BLOCKS):
        raise SystemExit(f"install_page: {PAGE.name} has {len(blocks)} bash blocks, not {BLOCKS}")
    clone = tmp / "bucketddp"
    _fresh_copy(clone)
    index = _local_cpu_index(tmp / "cpu-index", env)
    script = ["set -euxo pipefail"]
    for name, block in zip(BLOCKS, blocks, strict=True):
        if name == "cpu torch" and CPU_INDEX not in block:
            raise SystemExit(f"install_page: the CPU torch block names no {CPU_INDEX}")
        lines = [line for line in block.splitlines() if not line.startswith("python3 dev.py")]
        script += [line.replace(CPU_INDEX, index.as_uri()) for line in lines]
        script += _AFTER.get(name, [])
    run_env = dict(env, PIP_NO_COMPILE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    run_env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(["bash", "-c", "\n".join(script)], cwd=clone, env=run_env)
    if done.returncode != 0:
        raise SystemExit(f"install_page: a command of {PAGE.name} failed ({done.returncode})")
    venv = tmp / "bucketddp-env"
    if not (venv / "bin" / "python").exists():
        raise SystemExit(f"install_page: the page made no environment at {venv}")
    print(f"install_page: every command of {PAGE.name} ran, from a fresh copy", flush=True)
    return venv


if __name__ == "__main__":
    # Alone: python tools/install_page.py (after python3 dev.py wheel made dist/).
    import tempfile

    base_env = dict(os.environ, PIP_CONSTRAINT=str(ROOT / "constraints.txt"))
    with tempfile.TemporaryDirectory(prefix="bucketddp-page-") as tmp_dir:
        install_as_the_page_says(Path(tmp_dir), base_env)
