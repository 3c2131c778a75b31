"""The words of the fault reports: who is named, for which records (pure functions)."""

from __future__ import annotations

from typing import Any

from bucketddp.faults.report import cause, failed_message, origins, stall_culprits, stall_message


def _report(rank: int, step: int, waiting: bool, detail: str = "x") -> dict[str, Any]:
    return {
        "rank": rank,
        "host": "h",
        "pid": 100 + rank,
        "step": step,
        "phase": "user code",
        "waiting": waiting,
        "detail": detail,
        "idle": 5.0,
        "stacks": f"stack of {rank}",
    }


def test_the_stalled_ranks_are_those_the_others_wait_for() -> None:
    # Rank 2 is in user code while 0 and 1 wait in a collective: rank 2 is named.
    assert stall_culprits([_report(0, 5, True), _report(1, 5, True), _report(2, 4, False)], 3) == [
        2
    ]
    # A rank that did not answer at all is named too.
    assert stall_culprits([_report(0, 5, True)], 2) == [1]
    # Everyone waits (a collective that never completes): those behind are named.
    assert stall_culprits([_report(0, 6, True), _report(1, 5, True), _report(2, 5, True)], 3) == [
        1,
        2,
    ]


def test_a_stall_report_names_the_rank_and_carries_every_ranks_stacks() -> None:
    text = stall_message(1, [_report(0, 5, True, "backward"), _report(1, 4, False)], 2, 30.0)
    assert text.startswith("rank 1 stops: no progress for over 30 s (stall_timeout)")
    assert "Stalled: rank 1 (host h, pid 101) after step 4's forward: x." in text
    assert "stack of 0" in text and "stack of 1" in text
    assert text.index("stack of 1") < text.index("stack of 0")  # the stalled rank's first


def test_a_failure_names_the_first_rank_not_those_that_failed_because_of_it() -> None:
    raised = {"rank": 1, "host": "h", "pid": 7, "kind": "raised", "step": 5, "phase": "forward"}
    raised |= {"type": "ValueError", "message": "boom"}
    after = {
        "rank": 2,
        "kind": "raised",
        "type": "RankFailedError",
        "message": "",
        "secondary": True,
    }
    assert origins([raised, after]) == [raised]
    text = failed_message(0, [raised, after])
    assert text.startswith(
        "rank 0 stops because rank 1 (host h, pid 7) failed at step 5, in forward: "
        "ValueError: boom."
    )
    killed = {"rank": 3, "host": "h", "pid": 9, "kind": "signal", "signal": "SIGKILL", "seen_by": 0}
    assert "rank 3 (host h, pid 9) was killed by signal SIGKILL (seen by its parent process, " in (
        failed_message(1, [killed])
    )
    assert "traceback" not in failed_message(1, [killed])


def test_a_lost_store_names_its_host_rank0_or_torchruns_agent() -> None:
    assert "rank 0 hosts the rendezvous store" in cause({"rank": 0, "kind": "unreachable"})
    agent = cause({"rank": 0, "kind": "unreachable", "agent": True})
    assert "torchrun's agent on the first node hosts" in agent and "rank 0" not in agent
