"""The fault matrix of docs/reliability.md: what each DDP does when rank 1 fails at step 5.

    python benchmarks/fault_matrix.py [--cap 60] [--stall 10] [--out DIR]

Runs ``tools/fault_script.py`` jobs of two ranks for torch DDP and bucketddp, in a
hand-written loop (ranks started side by side, as torchrun does) and under Lightning
("ddp" and BucketDDP, Lightning's launcher), where rank 1 raises, is killed with SIGKILL or
sleeps forever at step 5. For each it prints how long after the fault the last rank was
gone (or that some rank was still running at ``--cap`` s and was killed), rank 0's exit
code, and rank 0's last error line. Jobs run a few at a time; the seconds are coarse.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "tools"))  # fault_runs

from fault_runs import Job, start, wait

SCENARIOS = {"raise": "raises ValueError", "kill": "SIGKILL", "sleep": "sleeps forever"}
SYSTEMS = {
    ("loop", "torch"): "torch DDP",
    ("loop", "bucketddp"): "BucketDataParallel",
    ("lightning", "torch"): 'Lightning "ddp"',
    ("lightning", "bucketddp"): "BucketDDP",
}


def last_error(job: Job, width: int = 110) -> str:
    """Rank 0's last line that looks like an error, shortened to ``width``."""
    lines = [
        line.removeprefix("[rank0]: ").strip()
        for line in job.output(0).splitlines()
        if (job.mode == "loop" or line.startswith("[rank0]:") or line.startswith("bucketddp:"))
        and re.search(r"(Error|error|Killed|stops)", line)
        and not line.lstrip().startswith("File ")
    ]
    if not lines:
        return "(no error printed)"
    text = lines[-1]
    text = re.sub(r"\[/__w/pytorch[^\]]*\] ", "", text)
    return text[:width] + ("..." if len(text) > width else "")


def row(job: Job, system: str, cap: float) -> str:
    """One markdown row for ``job``."""
    fault = job.fault_time
    gone = max(job.exited_at.values(), default=None) if len(job.exited_at) == 2 else None
    if fault is None:
        took = "rank 1 never faulted"
    elif gone is None or gone - fault > cap:
        took = f"still running at {cap:.0f} s (killed)"
    else:
        took = f"{gone - fault:.1f} s"
    code = job.codes.get(0)
    code_text = "-" if code is None else (f"signal {-code}" if code < 0 else str(code))
    named = "yes" if re.search(r"rank 1\b", last_error(job, 100_000)) else "no"
    return (
        f"| {SCENARIOS[job.scenario]} | {system} | {took} | {code_text} | {named} | "
        f"`{last_error(job)}` |"
    )


def main() -> int:
    """Run the matrix and print it as a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cap", type=float, default=60.0, help="seconds to wait per job")
    parser.add_argument("--stall", type=float, default=10.0, help="bucketddp's stall_timeout")
    parser.add_argument("--out", type=Path, default=None, help="keep the jobs' output here")
    parser.add_argument("--parallel", type=int, default=4, help="jobs at a time")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="fault-matrix-"))
    plan = [(s, m, sy) for s in SCENARIOS for (m, sy) in SYSTEMS]
    rows: dict[tuple[str, str, str], str] = {}
    for i in range(0, len(plan), args.parallel):
        batch = plan[i : i + args.parallel]
        jobs = {
            key: start(key[1], key[0], out / "-".join(key), stall=args.stall, system=key[2])
            for key in batch
        }
        wait(list(jobs.values()), timeout=args.cap + 30)
        for key, job in jobs.items():
            rows[key] = row(job, SYSTEMS[(key[1], key[2])], args.cap)
            print(f"done: {'/'.join(key)}", file=sys.stderr, flush=True)
    print(
        "| rank 1 at step 5 | system | every rank gone after | rank 0 exit | names rank 1 | "
        "rank 0's last error line |"
    )
    print("|---|---|---|---|---|---|")
    for key in plan:
        print(rows[key])
    print(f"\n(outputs in {out}; stall_timeout={args.stall:g} s for bucketddp)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
