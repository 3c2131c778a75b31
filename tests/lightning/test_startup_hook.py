"""The interpreter-start hook (bucketddp-strategy-names.pth), in the environment under test.

An install of bucketddp, editable (the dev .venv) or from the wheel, puts the hook in
site-packages. These tests start fresh interpreters of that environment: the hook loads
nothing heavy at start, registers our names when Lightning is imported by a program that
never imports bucketddp, and ``BUCKETDDP_NO_STARTUP_HOOK=1`` switches it off.
check_wheel.py fits through the names from the installed wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

HOOK_SWITCH = "BUCKETDDP_NO_STARTUP_HOOK"


def _fresh(code: str, hook: bool = True) -> dict[str, object]:
    """Run ``code`` in a new interpreter of this environment, outside the source tree; it
    prints one JSON object, returned here."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", HOOK_SWITCH)}
    if not hook:
        env[HOOK_SWITCH] = "1"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(sys.executable).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Error processing line" not in done.stderr, done.stderr
    return dict(json.loads(done.stdout.splitlines()[-1]))


_AT_START = """
import json, sys
heavy = sorted(m for m in ("torch", "bucketddp", "lightning", "importlib.abc") if m in sys.modules)
print(json.dumps({"heavy": heavy, "finder": any(
    type(f).__name__ == "AfterLightningImport" for f in sys.meta_path)}))
"""

_NAMES = """
import json, sys
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
print(json.dumps({"trainer": "bucket_ddp" in StrategyRegistry,
    "fabric": "bucket_ddp" in STRATEGY_REGISTRY,
    "finder_left": any(type(f).__name__ == "AfterLightningImport" for f in sys.meta_path)}))
"""


def test_the_hook_loads_nothing_heavy_at_start() -> None:
    assert _fresh(_AT_START) == {"heavy": [], "finder": True}
    assert _fresh(_AT_START, hook=False) == {"heavy": [], "finder": False}


def test_the_names_are_registered_without_importing_bucketddp() -> None:
    assert _fresh(_NAMES) == {"trainer": True, "fabric": True, "finder_left": False}


def test_the_switch_turns_the_hook_off() -> None:
    assert _fresh(_NAMES, hook=False) == {"trainer": False, "fabric": False, "finder_left": False}
