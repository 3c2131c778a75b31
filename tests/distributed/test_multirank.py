"""The multi-rank helper itself: a rank that dies or hangs is reported with its stacks, and
a group that did not form (its port taken by another job) is started once more."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import multirank
from multirank import RankError, alive, run_ranks


def abort_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        os.abort()  # as glibc does on heap corruption
    return rank


def hang_on_rank_1(rank: int, world: int, pids: str) -> int:
    with open(pids, "a") as f:
        print(os.getpid(), file=f, flush=True)
    if rank == 1:
        dist.barrier()  # rank 0 never joins it
    else:
        time.sleep(3600)  # and never ends, which would end rank 1's wait with an error
    return rank


def test_a_rank_that_dies_of_a_signal_is_reported_with_its_stack() -> None:
    with pytest.raises(RankError) as info:
        run_ranks(abort_on_rank_1, 2, timeout=60)
    message = str(info.value)
    assert "rank 1 died (exit code -6)" in message
    assert "abort_on_rank_1" in message  # faulthandler's stack of the main thread


def test_a_rank_that_hangs_is_reported_with_its_stack_and_ended(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    with pytest.raises(TimeoutError) as info:
        run_ranks(hang_on_rank_1, 2, str(pids), timeout=4)
    message = str(info.value)
    assert "ranks still running: [0, 1]" in message
    assert "in barrier" in message and "hang_on_rank_1" in message
    # Ended, not waited for: rank 0 would sleep for an hour (the suite's timeout ends first).
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 2 and not any(alive(pid) for pid in started), started


def count_calls(rank: int, world: int, calls: str, fail: bool) -> int:
    with open(calls, "a") as f:
        print(rank, file=f, flush=True)
    if fail:
        raise ValueError(f"boom on rank {rank}")
    return dist.get_world_size()


def test_a_group_that_did_not_form_is_started_once_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = tmp_path / "calls"
    real = multirank.free_port
    with socket.socket() as other_job:  # another job's server on the first port handed out
        other_job.bind(("127.0.0.1", 0))
        other_job.listen()
        ports = iter([other_job.getsockname()[1]])
        monkeypatch.setattr(multirank, "free_port", lambda: next(ports, None) or real())
        assert run_ranks(count_calls, 2, str(calls), False, timeout=60) == [2, 2]
    assert sorted(calls.read_text().split()) == ["0", "1"]  # fn ran once per rank


def test_a_failure_in_the_function_is_not_run_again(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    with pytest.raises(RankError, match="boom on rank"):
        run_ranks(count_calls, 2, str(calls), True, timeout=60)
    assert sorted(calls.read_text().split()) == ["0", "1"]
