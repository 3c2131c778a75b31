"""Errors end a user's processes with exit code 1, never a signal (SIGABRT).

Each run is two fresh ``python`` processes of a plain script that fails on both ranks and
lets its error reach the top level (``tools/error_exits.py``): ending a process
is the point, so a run cannot be shortened into a function call. A few runs here; the
30-run count is ``benchmarks/error_exit_status.py``.
"""

from __future__ import annotations

import argparse

import pytest

from error_exits import run_once


@pytest.mark.parametrize(("scenario", "runs"), [("mismatch", 2), ("unused", 1)])
def test_ranks_exit_with_code_1_after_an_error(scenario: str, runs: int, tmp_path: str) -> None:
    # A hang guard per run: two fresh interpreters import torch, about 25 s under load.
    args = argparse.Namespace(scenario=scenario, wrapper="ours", timeout=150.0)
    for _ in range(runs):
        result = run_once(args, str(tmp_path))
        assert result["codes"] == [1, 1] and result["aborts"] == 0, result
        expected = "differs from rank 0" if scenario == "mismatch" else "received no gradient"
        assert all(expected in " ".join(e) for e in result["errors"]), result
