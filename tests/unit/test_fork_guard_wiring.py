"""bucketddp.fork_guard: which Pythons get it, and that ``import bucketddp`` wires it to
``os.fork``. What it does for a fork beside gloo's threads: tests/distributed/test_fork_guard.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bucketddp import fork_guard


@pytest.mark.parametrize(
    ("version", "has_bug"),
    [
        ((3, 10, 12), True),
        ((3, 10, 14), True),
        ((3, 10, 15), False),
        ((3, 11, 7), True),
        ((3, 11, 9), True),
        ((3, 11, 10), False),
        ((3, 12, 0), False),
        ((3, 13, 1), False),
    ],
)
def test_affected_pythons(version: tuple[int, int, int], has_bug: bool) -> None:
    assert fork_guard.affected(version) is has_bug


# In a new interpreter: whether the guard runs before a fork, and how often.
_PROBE = """
import os
import bucketddp
from bucketddp import fork_guard
calls = []
fork_guard._walk_thread_states = lambda: calls.append(1)
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print(fork_guard.affected(), fork_guard._installed, len(calls))
"""


def test_import_bucketddp_guards_each_fork_on_affected_pythons_only() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    affected, installed, calls = done.stdout.split()
    assert installed == affected
    assert calls == ("1" if affected == "True" else "0")


def test_the_lock_walk_finds_no_thread() -> None:
    # Thread id 0 matches no thread state: the call only takes and frees the lock.
    assert fork_guard._walk_thread_states() == 0
