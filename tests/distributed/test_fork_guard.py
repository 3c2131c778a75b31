"""bucketddp's fork guard against CPython's gh-112275 (``bucketddp.fork_guard``), on real
gloo ranks that fork beside a stream of collectives (``tools/fork_repro.py``).

The ground truth: the same ranks without the guard, where about one forked child in a
thousand never starts (it waits forever in ``PyOS_AfterFork_Child``). With the guard, none
may. Only on a Python that has the bug; whole programs of about 30 s each, so in the jobs
tier.
"""

from __future__ import annotations

import pytest

from bucketddp.fork_guard import affected
from fork_repro import _rank
from multirank import run_ranks

pytestmark = [
    pytest.mark.jobs,
    pytest.mark.skipif(not affected(), reason="this Python resets the lock in the child"),
]

FORKS = 2000  # per rank; without the guard about 1 in 1,000 children hung here


def _hung(guard: bool) -> int:
    results = run_ranks(_rank, 2, FORKS, "fork", guard, timeout=600, fresh=True)
    return sum(stuck for stuck, _ in results)


@pytest.mark.timeout(900)  # a hang guard: up to three runs of two ranks forking
def test_without_the_guard_some_forked_children_never_start() -> None:
    # The ground truth that the ranks reach the hazard; a second run guards against a
    # rare run that misses it (about 3% of runs of this size here).
    hung = _hung(guard=False) or _hung(guard=False)
    assert hung > 0


@pytest.mark.timeout(600)
def test_with_the_guard_every_forked_child_starts() -> None:
    assert _hung(guard=True) == 0
