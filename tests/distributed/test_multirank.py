"""The multi-rank helper itself: a rank that dies or hangs is reported with its stacks."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from multirank import RankError, run_ranks


def abort_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        os.abort()  # as glibc does on heap corruption
    return rank


def hang_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        dist.barrier()  # rank 0 never joins it
    else:
        time.sleep(60)  # and never ends, which would end rank 1's wait with an error
    return rank


def test_a_rank_that_dies_of_a_signal_is_reported_with_its_stack() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(abort_on_rank_1, 2, timeout=30)
    message = str(info.value)
    assert "rank 1 died (exit code -6)" in message
    assert "abort_on_rank_1" in message  # faulthandler's stack of the main thread


def test_a_rank_that_hangs_is_reported_with_its_stack() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_ranks(hang_on_rank_1, 2, timeout=4)
    message = str(info.value)
    assert "ranks still running: [0, 1]" in message
    assert "in barrier" in message and "hang_on_rank_1" in message
    assert time.monotonic() - start < 20
