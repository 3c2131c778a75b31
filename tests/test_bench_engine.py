"""The engine benchmark as users run it: one short real run on 2 gloo ranks.

Timings are not checked (they live in the benchmark's output, not in tests). What is checked
is what the benchmark reports about the two engines: with default options bucketddp and
torch DDP reduce the same buckets, read from torch DDP's own logging data, and the bucket
options reach bucketddp.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_engine.py"
# Three steps in all: torch DDP reports its rebuilt buckets from its third forward on.
SHORT = ["--rounds", "1", "--steps", "1", "--warmup", "2", "--world-size", "2", "--no-memory"]


def run_bench(tmp_path: Path, *extra: str) -> dict[str, Any]:
    """Run the benchmark script on the transformer and return its JSON report."""
    out = tmp_path / "engine.json"
    cmd = [sys.executable, str(SCRIPT), "--models", "transformer", *SHORT, *extra]
    proc = subprocess.run(
        [*cmd, "--json", str(out)], capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bucketddp/torch_ddp" in proc.stdout
    report: dict[str, Any] = json.loads(out.read_text())
    return report["world_size_2"]["transformer"]


def test_default_buckets_match_torch_ddp(tmp_path: Path) -> None:
    result = run_bench(tmp_path)
    theirs = result["torch_ddp_bucket_mb"]
    if theirs is None:
        pytest.skip("this torch's DDP does not report its rebuilt bucket sizes")
    assert len(theirs) >= 2  # a small first bucket, then the rest
    assert result["bucketddp_bucket_mb"] == pytest.approx(theirs, abs=0.01)
    assert set(result["systems"]) == {"local", "torch_ddp", "bucketddp"}


def test_first_bucket_option_reaches_bucketddp(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--first-bucket-mb", "25")
    assert result["bucketddp_buckets"] == 1


def test_bad_bucket_size_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--bucket-cap-mb", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "--bucket-cap-mb must be positive" in proc.stderr
