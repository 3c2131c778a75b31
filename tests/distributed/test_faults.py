"""A failure on one rank ends every rank, naming the failed rank (docs/reliability.md).

Real jobs of two processes, each in a hand-written loop (one process per rank, as torchrun
starts them) and under Lightning's own script launcher, where rank 1 at its fifth step
raises, is killed with SIGKILL, or sleeps forever; and one under Lightning's spawn launcher
where rank 1 raises. All seven jobs run side by side to keep the suite short.

The test waits for every process to exit, with a hang guard far below what a rank would
wait without the watchdog (the process group's 30-minute timeout, for a peer that sleeps);
each rank's own error says that the watchdog ended it. How fast that is, a timing, is
``benchmarks/fault_matrix.py``'s to report (docs/reliability.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fault_runs import Job, start, wait

pytestmark = pytest.mark.jobs  # seven jobs, one rank of each failing

pytest.importorskip("lightning")

STALL = 4.0  # the stall timeout of the jobs that sleep
HANG_GUARD = 240.0  # seconds for all seven jobs, start to end (the suite's timeout is 300)


def _gone(job: Job) -> list[str]:
    if job.fault_time is None:
        return [f"{job.mode}/{job.scenario}: rank 1 never reached its fault"]
    return [
        f"{job.mode}/{job.scenario}: rank {rank} still running at the hang guard (killed)"
        for rank in range(2)
        if rank not in job.exited_at
    ]


@pytest.mark.compat("watchdog")
def test_a_failing_rank_ends_every_rank_naming_it(tmp_path: Path) -> None:
    cases = [(m, s) for m in ("loop", "lightning") for s in ("raise", "kill", "sleep")]
    cases.append(("spawn", "raise"))  # Lightning's spawn launcher: no on_exception in ranks
    cases.append(("loop", "broadcast"))  # rank 1 waits in a collective bucketddp never made
    jobs = {
        (mode, scenario): start(
            "loop" if mode == "loop" else "lightning",
            scenario,
            tmp_path / f"{mode}-{scenario}",
            stall=STALL if scenario in ("sleep", "broadcast") else 600.0,
            start_method="spawn" if mode == "spawn" else "popen",
        )
        for mode, scenario in cases
    }
    wait(list(jobs.values()), timeout=HANG_GUARD)
    problems: list[str] = []
    for (mode, scenario), job in jobs.items():
        problems += _gone(job)
        out = job.output(0)
        if mode == "spawn":
            # The spawn launcher ends rank 0 itself as soon as rank 1 fails, often before
            # rank 0's watchdog speaks; the launcher's own error names rank 1 then.
            named = ("rank 0 stops because rank 1 (host", "Process 1 terminated with")
            if not any(text in out for text in named):
                problems.append("spawn/raise: neither rank 0 nor the launcher names rank 1")
            expect = ["ValueError: boom at step 5"]
        elif scenario == "raise":
            expect = ["rank 0 stops because rank 1 (host", "ValueError: boom at step 5"]
        elif scenario == "kill":
            expect = ["rank 0 stops because rank 1 (host"]
            # Lightning's rank 0 launched rank 1 and sees its signal; side by side it cannot.
            expect += (
                ["was killed by signal SIGKILL"]
                if mode == "lightning"
                else ["died without reporting an error", "killed by a signal or the OOM killer"]
            )
        elif scenario == "broadcast":
            # Both ranks wait; the report names rank 1's broadcast and its caller.
            expect = ["rank 0 stops: no progress for over 4 s"]
            expect += [
                "in torch.distributed.broadcast, called from",
                "fault_script.py",
                "(fault): a collective bucketddp did not launch; waits on the others",
            ]
        else:
            expect = ["rank 0 stops: no progress for over 4 s", "Stalled: rank 1 (host"]
            expect += ["Python stacks of rank 0", "Python stacks of rank 1", "fault_script.py"]
        problems += [
            f"{mode}/{scenario}: rank 0's output lacks {text!r}"
            for text in expect
            if text not in out
        ]
        if mode == "loop":
            # Every error path exits with a code; the killed rank alone dies of a signal.
            want = {0: 1, 1: -9 if scenario == "kill" else 1}
            if job.codes != want:
                problems.append(f"loop/{scenario}: exit codes {job.codes}, wanted {want}")
            if scenario == "sleep" and "Stalled: rank 1 (host" not in job.output(1):
                problems.append("loop/sleep: rank 1's own error does not name it as stalled")
        elif job.codes.get(0) != 1:
            problems.append(f"lightning/{scenario}: rank 0 exit code {job.codes.get(0)}, wanted 1")
    tails = {f"{m}/{s}": j.output(0)[-1500:] for (m, s), j in jobs.items()}
    assert not problems, (
        "\n".join(problems) + "\n" + "\n".join(f"== {k}\n{v}" for k, v in tails.items())
    )
