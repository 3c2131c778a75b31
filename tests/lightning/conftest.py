"""Launches that several Lightning test modules read: each runs once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_runs import scenario


@pytest.fixture(scope="session")
def lifecycle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The "lifecycle" scenario: fit, checkpoint every 4 steps, resume, evaluate (2 ranks)."""
    out = tmp_path_factory.mktemp("lifecycle")
    return out, scenario("lifecycle", out)


@pytest.fixture(scope="session")
def at_world_size_1(
    lifecycle: tuple[Path, list[dict[str, Any]]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    """The lifecycle's step-4 checkpoint resumed on one process; it also saves ws1.ckpt."""
    out = tmp_path_factory.mktemp("at_world_size_1")
    (r,) = scenario("resume_elsewhere", out, str(lifecycle[0] / "checkpoints" / "step=4.ckpt"))
    return out, r
