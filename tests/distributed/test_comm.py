"""The wrapper's own small collectives, on real gloo process groups."""

from __future__ import annotations

from typing import Any

import torch

from bucketddp.comm import gather_if_different
from multirank import run_ranks

CPU = torch.device("cpu")


def _gathers(rank: int, world: int) -> dict[str, Any]:
    same = [("parameter", "fc.weight", (4, 8), "torch.float32"), ("buffer", "n", (), "x")]
    # Differs on the last rank only, by one element of a shape: the other ranks' own
    # fingerprints agree with each other, and they must still take part in the gather.
    shape = (4, 9) if rank == world - 1 else (4, 8)
    differ = [("parameter", "fc.weight", shape, "torch.float32")]
    return {
        "same": gather_if_different(same, None, CPU),
        "differ": gather_if_different(differ, None, CPU),
        # Same text length, other content: the checksums must tell them apart.
        "swapped": gather_if_different("ab" if rank == 0 else "ba", None, CPU),
    }


def test_gather_if_different_gathers_on_every_rank_exactly_when_some_rank_differs() -> None:
    results = run_ranks(_gathers, 3)
    expected = [[("parameter", "fc.weight", s, "torch.float32")] for s in ((4, 8), (4, 8), (4, 9))]
    for r in results:
        assert r["same"] is None
        assert r["differ"] == expected
        assert r["swapped"] == ["ab", "ba", "ba"]
