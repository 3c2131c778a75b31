"""A forked child that never starts: CPython's gh-112275, with torch and gloo alone.

``python tools/fork_repro.py [--forks N] [--start fork|forkserver|spawn] [--guard]`` runs 2
gloo ranks (``multirank``). On each, a thread launches all-reduces one after the other, each
with a ``then`` callback, so that gloo's worker threads keep entering Python; meanwhile the
main thread starts ``N`` children that exit at once (as a ``DataLoader`` starts its
workers), and counts those still alive after a while (2 s for a fork, 60 s for a new
interpreter), killing them. ``--start`` is how children start: ``fork`` (``os.fork``, a
``DataLoader``'s default on Linux), or the ``multiprocessing`` start method of that name,
which a loader uses with ``multiprocessing_context=``. The ranks are new interpreters that
never import bucketddp, unless ``--guard`` has them install ``bucketddp.fork_guard`` (which
``import bucketddp`` installs), the guard this repro measures.

A thread that enters Python without a thread state of its own (a gloo worker running a
future's callback, or freeing a Python object a collective held) makes one under the
interpreter's runtime lock, without the GIL. On Python 3.10 before 3.10.15 and 3.11
before 3.11.10 a child forked at that moment waits on that lock forever in
``PyOS_AfterFork_Child``, before any of its own code runs. Here (Python 3.11.7, torch 2.13)
about one fork in 1,000 hangs so (none with ``--guard``); newer Pythons reset the lock first.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.context
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from multirank import run_ranks

STUCK_AFTER = {"fork": 2.0, "forkserver": 2.0, "spawn": 60.0}
"""Seconds: a child that exits at once and is still alive then hangs. A spawned child is a
new interpreter that imports this module (and torch) first."""


def _noop() -> None:
    """A started child's whole work."""


def _hung_fork() -> bool:
    """Fork a child that exits at once; whether it hung (it is killed then)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    start = time.monotonic()
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() - start > STUCK_AFTER["fork"]:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return True
        time.sleep(0.0005)
    return False


def _hung_start(ctx: multiprocessing.context.BaseContext, method: str) -> bool:
    """Start a child through ``ctx`` that exits at once; whether it hung (killed then)."""
    child = ctx.Process(target=_noop)  # type: ignore[attr-defined]
    child.start()
    child.join(STUCK_AFTER[method])
    if child.exitcode is None:
        child.kill()
        child.join()
        return True
    return False


def _rank(rank: int, world_size: int, forks: int, method: str, guard: bool) -> tuple[int, int]:
    """Start children while gloo's threads run callbacks; returns (children stuck, started)."""
    if guard:
        from bucketddp import fork_guard

        assert fork_guard.install(), "this Python has no gh-112275: no guard to measure"
    else:
        assert "bucketddp" not in sys.modules, "the repro must run without bucketddp"
    done = threading.Event()

    def churn() -> None:
        # Until every rank has started its children (the minimum of the "done" flags).
        while True:
            flag = torch.tensor([1.0 if done.is_set() else 0.0])
            work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, async_op=True)
            work.get_future().then(lambda _: None).wait()
            if flag.item() == 1.0:
                return

    ctx = multiprocessing.get_context(method)
    # multirank's ranks are daemonic, and multiprocessing refuses children to a daemon;
    # every child here is waited for, or killed, before the rank returns.
    multiprocessing.current_process().daemon = False
    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    stuck = 0
    for _ in range(forks):
        stuck += _hung_fork() if method == "fork" else _hung_start(ctx, method)
    done.set()
    thread.join()
    return stuck, forks


def main() -> None:
    """Run it and print each rank's count."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forks", type=int, default=3000, help="children each rank starts")
    parser.add_argument("--start", choices=sorted(STUCK_AFTER), default="fork",
                        help="how children start (default: os.fork)")
    parser.add_argument("--guard", action="store_true",
                        help="install bucketddp's fork guard in the ranks first")
    args = parser.parse_args()
    # fresh: new interpreters, which import torch and this module only (not bucketddp).
    results = run_ranks(_rank, 2, args.forks, args.start, args.guard, timeout=3600, fresh=True)
    from bucketddp.fork_guard import affected  # here only: the ranks must not import it

    python = ".".join(map(str, sys.version_info[:3]))
    bug = "yes" if affected() else "fixed"
    guard = "with" if args.guard else "without"
    print(f"Python {python} (gh-112275: {bug}), torch {torch.__version__}, {guard} the guard")
    for rank, (stuck, forks) in enumerate(results):
        print(f"rank {rank}: {stuck} of {forks} children ({args.start}) hung")


if __name__ == "__main__":
    main()
