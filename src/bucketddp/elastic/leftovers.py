"""The snapshots that jobs left on this node: listed, and removed when asked.

A job removes its snapshots when it ends for good (``session.py``, ``ending.py``). A job
with no process left to do it leaves them: every worker and the agent SIGKILLed, a job
stopped on a notice (kept so that a job started again with the same run id resumes), an
agent stopped by Ctrl-C before the last attempt. ``python -m bucketddp.snapshots`` (``main``)
lists this user's job folders under the snapshot root and removes the ones it is told to.

Nothing removes them by itself: no test of "this job is gone" is sound. Between two
attempts no worker runs while torchrun's agent, which bucketddp does not control, is about
to start the next; the job's other processes may be on other hosts, or in another pid
namespace. The user says which jobs are over.

It touches only the caller's own ``<root>/bucketddp-<uid>`` and the folders in it, each
opened and checked as training checks them (``folder.py``): private, this user's, never
through a symlink. A folder whose files a process on this host has mapped (a running
worker keeps its snapshot files mapped) is said to be in use, and is removed only with
``--force``; a process in another pid namespace, or between two attempts, is not seen.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .folder import Folder, UnsafeFolder
from .job import user_folder
from .room import size_text

PROG = "python -m bucketddp.snapshots"


@dataclass(frozen=True)
class JobFolder:
    """One job's folder of snapshots on this node."""

    run: str  # the folder's name: the run id, made safe for a file name
    nbytes: int
    files: int
    changed: float | None  # when a file in it last changed
    users: tuple[int, ...]  # pids of processes on this host that have its files mapped
    problem: str | None = None  # why it is not read (it is not a private folder of ours)


def users_of(path: Path) -> tuple[int, ...]:
    """The pids of this host's processes (those ``/proc`` shows) that map a file in
    ``path``."""
    prefix = os.path.realpath(path) + "/"
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{entry}/maps") as maps:
            if any(prefix in line for line in maps):
                found.append(int(entry))
    return tuple(found)


def _open_run(parent: Path, run: str) -> Folder:
    return Folder.open(parent / run, private=2)


def find(root: str | Path | None = None) -> list[JobFolder]:
    """This user's job folders under ``root`` (see ``user_folder``), by name. Raises
    ``UnsafeFolder`` if the per-user folder is not a private one of this user's."""
    parent = user_folder(root)
    if not os.path.lexists(parent):
        return []
    out = []
    for run in sorted(Folder.open(parent).names()):
        try:
            folder = _open_run(parent, run)
        except UnsafeFolder as e:
            out.append(JobFolder(run, 0, 0, None, (), problem=str(e)))
            continue
        try:
            files, changed = len(folder.names()), folder.last_change()
            out.append(JobFolder(run, folder.bytes_held(), files, changed, users_of(folder.path)))
        finally:
            folder.close()
    return out


def remove(run: str, root: str | Path | None = None) -> int:
    """Remove job folder ``run`` of this user's (a name ``find`` lists), and the per-user
    folder if it is left empty; the number of files removed. Raises ``ValueError`` for a
    name that is not one of this user's job folders, ``UnsafeFolder`` for one that is not
    private."""
    parent = user_folder(root)
    if not os.path.lexists(parent) or run not in Folder.open(parent).names():
        raise ValueError(f"{parent} holds no job folder {run!r}")
    folder = _open_run(parent, run)
    try:
        return folder.remove_all(parents=1)
    finally:
        folder.close()


def _age(changed: float | None) -> str:
    if changed is None:
        return "-"
    seconds = max(0.0, time.time() - changed)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _list(root: str | None) -> int:
    found = find(root)
    if not found:
        print(f"no snapshots under {user_folder(root)}")
        return 0
    print(f"{user_folder(root)}:")
    print(f"{'RUN':<40} {'SIZE':>10} {'FILES':>5}  {'LAST WRITTEN':<14} IN USE BY")
    for f in found:
        if f.problem is not None:
            print(f"{f.run:<40} not read: {f.problem}")
            continue
        users = ", ".join(f"pid {p}" for p in f.users) or "-"
        size = size_text(f.nbytes)
        print(f"{f.run:<40} {size:>10} {f.files:>5}  {_age(f.changed):<14} {users}")
    return 0


def _remove(root: str | None, runs: list[str], every: bool, force: bool) -> int:
    if every:
        runs = [f.run for f in find(root) if f.problem is None]
    failed = 0
    for run in runs:
        parent = user_folder(root)
        users = users_of(parent / run) if os.path.isdir(parent / run) else ()
        if users and not force:
            pids = ", ".join(str(p) for p in users)
            print(f"{run}: kept, in use by pid {pids} (a running job; --force removes it)")
            failed += not every
            continue
        try:
            removed = remove(run, root)
        except (ValueError, UnsafeFolder) as e:
            print(f"{run}: not removed: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"{run}: removed ({removed} files)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """The command line: ``list``, or ``remove RUN... | --all [--force]``; the exit code."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="List or remove the elastic-training snapshots this user's jobs left on "
        "this node (docs/elastic.md, 'What is left in /dev/shm').",
    )
    parser.add_argument(
        "--root", help="the snapshot root (default: $BUCKETDDP_SNAPSHOT_DIR, else /dev/shm)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list this user's job folders: size, age, users")
    rm = commands.add_parser("remove", help="remove job folders, by the names list shows")
    rm.add_argument("runs", nargs="*", metavar="RUN")
    rm.add_argument("--all", action="store_true", help="every job folder not in use")
    rm.add_argument("--force", action="store_true", help="also a folder in use")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            return _list(args.root)
        if not args.runs and not args.all:
            parser.error("remove: name the job folders (RUN ...), or --all")
        return _remove(args.root, args.runs, args.all, args.force)
    except UnsafeFolder as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
