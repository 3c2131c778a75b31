"""A forked child that never starts: CPython's gh-112275, with torch and gloo alone.

``python tools/fork_repro.py [--collectives N]`` runs 2 gloo ranks (``multirank``). On each,
a thread launches ``N`` all-reduces one after the other, each with a ``then`` callback, so
that gloo's worker threads keep entering Python; meanwhile the main thread forks children
that exit at once (as a ``DataLoader`` forks its workers), and counts those still alive
after 2 s, killing them. The ranks are new interpreters that never import bucketddp.

A thread that enters Python without a thread state of its own (a gloo worker running a
future's callback, or freeing a Python object a collective held) makes one under the
interpreter's runtime lock, without the GIL. On Python 3.10 before 3.10.15 and 3.11
before 3.11.10 a child forked at that moment waits on that lock forever in
``PyOS_AfterFork_Child``, before any of its own code runs. Here (Python 3.11.7, torch 2.13)
about one fork in 1,500 hangs so; newer Pythons reset the lock first.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from multirank import run_ranks

STUCK_AFTER = 2.0  # seconds: a child that exits at once and is still alive then hangs


def affected(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether this CPython has gh-112275 (fixed in 3.10.15, 3.11.10 and 3.12)."""
    fixed_in = {10: (3, 10, 15), 11: (3, 11, 10)}.get(version[1]) if version[0] == 3 else None
    return fixed_in is not None and tuple(version) < fixed_in


def _rank(rank: int, world_size: int, collectives: int) -> tuple[int, int]:
    """Fork while gloo's threads run callbacks; returns (children stuck, forks)."""
    assert "bucketddp" not in sys.modules, "the repro must run without bucketddp"
    tensor = torch.ones(4)

    def churn() -> None:
        for _ in range(collectives):
            work = dist.all_reduce(tensor, async_op=True)
            work.get_future().then(lambda _: None).wait()

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    stuck = forks = 0
    while thread.is_alive():
        forks += 1
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        start = time.monotonic()
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() - start > STUCK_AFTER:
                stuck += 1
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.0005)
    thread.join()
    return stuck, forks


def main() -> None:
    """Run it and print each rank's count."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collectives", type=int, default=6000, help="all-reduces per rank")
    args = parser.parse_args()
    # fresh: new interpreters, which import torch and this module only (not bucketddp).
    results = run_ranks(_rank, 2, args.collectives, timeout=600, fresh=True)
    python = ".".join(map(str, sys.version_info[:3]))
    bug = "yes" if affected() else "fixed"
    print(f"Python {python} (gh-112275: {bug}), torch {torch.__version__}")
    for rank, (stuck, forks) in enumerate(results):
        print(f"rank {rank}: {stuck} of {forks} forked children hung")


if __name__ == "__main__":
    main()
