"""The one build step pyproject.toml cannot declare: ship ``bucketddp-strategy-names.pth``.

Everything else about the package is in pyproject.toml. The ``.pth`` file goes to the root
of the wheel, so that pip puts it in site-packages, where the interpreter runs its one line
at start-up: it installs the finder of ``src/_bucketddp_startup.py``, which registers
"bucket_ddp" and its twins with Lightning when Lightning is imported (docs/strategy.md).
An editable install (``pip install -e .``) gets the same file.
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "bucketddp-strategy-names.pth"
SWITCH = "BUCKETDDP_NO_STARTUP_HOOK"
"""Set to anything but "" or "0", it keeps the hook from loading anything."""
PTH_LINE = (
    f'import os; os.environ.get("{SWITCH}", "") in ("", "0")'
    ' and __import__("_bucketddp_startup").install()\n'
)


class BuildPyWithPth(build_py):
    """``build_py``, plus the ``.pth`` file at the root of what goes into the wheel."""

    def run(self) -> None:
        super().run()
        # An editable wheel is assembled in the install command's directory, not build_lib.
        root = (
            self.distribution.get_command_obj("install").install_lib
            if self.editable_mode
            else self.build_lib
        )
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, PTH_NAME), "w") as pth:
            pth.write(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH_NAME)]


setup(cmdclass={"build_py": BuildPyWithPth})
