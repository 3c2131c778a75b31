"""examples/demo.py's training on 2 gloo ranks: bucketddp learns the digits with torch DDP's
weights, in a few steps."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.append(str(EXAMPLES))

import demo  # noqa: E402  (examples/demo.py)

from multirank import run_ranks  # noqa: E402

STEPS = 12


def test_demo_trains_bucketddp_to_torch_ddp_weights() -> None:
    ranks = run_ranks(demo.train, 2, STEPS)
    result = ranks[0]
    assert result["steps"] == STEPS
    # Each rank trains on its own half of every batch: without an all-reduce of every
    # gradient the weights would part from torch DDP's in the first step.
    assert result["bytes_reduced"] >= 4 * result["parameters"]
    assert result["max_difference"] <= demo.TOLERANCE
    accuracy = result["accuracy"]
    assert accuracy["bucketddp"] == accuracy["torch DDP"]
    assert [r["accuracy"] for r in ranks[1:]] == [accuracy]
    # 12 steps of 64 images already beat chance (10%) by far on the 297 held-out digits.
    assert accuracy["bucketddp"] > 0.6
